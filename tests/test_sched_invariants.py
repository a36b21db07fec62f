"""Scheduler invariants on random workloads, for every policy (torch-free code under test).

Each run replays the chunk stream into a fake paged KV store (ChunkStreamChecker) and the
fake model's next token is a hash of the KV the request actually reads, so any KV mistake
(wrong block, block overwritten while in use, prefix not stored yet) changes the outputs.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz import examples

from batchllm.sched.checker import ChunkStreamChecker
from batchllm.sched.config import SchedulerConfig
from batchllm.sched.factory import make_scheduler
from batchllm.sched.interface import SchedRequest

POLICIES = ("batchllm", "vllm", "sglang", "simple")
VOCAB = 50


def _requests(spec) -> list[SchedRequest]:
    return [SchedRequest(i, list(prompt), max_tokens) for i, (prompt, max_tokens) in enumerate(spec)]


def run(spec, config: SchedulerConfig, stop_mod: int | None = None, max_steps: int = 20000):
    """Engine loop with a deterministic fake model; returns (outputs, scheduler, stats)."""
    requests = _requests(spec)
    checker = ChunkStreamChecker(requests, config.block_size)
    sched = make_scheduler(config)
    sched.add_requests(requests)
    outputs: dict[int, tuple[int, ...]] = {}
    max_used = preemptions = 0
    prefix_freed_checks = 0
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        preemptions += len(out.preempted_request_ids)
        max_used = max(max_used, sched.pool.num_used_blocks if config.policy == "batchllm" else out.num_used_blocks)
        seen = checker.check_step(out)
        groups_before = {}
        if config.policy == "batchllm":
            groups_before = {g.group_id: (g, list(g.prefix_block_ids)) for g in sched.active_groups}
        sampled, finish = {}, {}
        for rid, visible in seen.items():
            token = hash(visible) % VOCAB
            sampled[rid] = token
            num_out = len(checker.outputs[rid]) + 1
            if num_out >= requests[rid].max_tokens or (stop_mod and token % stop_mod == 0):
                finish[rid] = "length" if num_out >= requests[rid].max_tokens else "stop"
        for rid, token in sampled.items():
            requests[rid].output_token_ids.append(token)  # read: the caller's list
        finished = sched.update(out, finish)
        checker.record(sampled, [f.request_id for f in finished])
        assert {f.request_id for f in finished} == set(finish)
        for item in finished:
            assert item.request_id not in outputs, "finished twice"
            outputs[item.request_id] = tuple(requests[item.request_id].output_token_ids)
            assert list(outputs[item.request_id]) == checker.outputs[item.request_id]
        # BatchLLM 4.3.1: a group's prefix blocks are freed when its last member ends.
        for group, block_ids in groups_before.values():
            if all(m.finished for m in group.members):
                assert group not in sched.active_groups
                assert all(sched.pool.ref_count(b) == 0 for b in block_ids)
                prefix_freed_checks += 1
    else:
        raise AssertionError("did not finish")
    assert sched.pool.num_free_blocks == sched.pool.num_blocks, "KV blocks leaked"
    return outputs, sched, {"max_used": max_used, "preemptions": preemptions, "prefix_freed": prefix_freed_checks}


@st.composite
def workloads(draw):
    """Groups of prompts sharing prefixes (plus accidental sharing from a tiny vocabulary)."""
    seed = draw(st.integers(0, 2**31 - 1))
    rng = random.Random(seed)
    spec = []
    for _ in range(draw(st.integers(1, 6))):
        prefix = [rng.randrange(VOCAB) for _ in range(draw(st.integers(0, 40)))]
        for _ in range(draw(st.integers(1, 5))):
            distinct = [rng.randrange(VOCAB) for _ in range(draw(st.integers(1, 20)))]
            spec.append((prefix + distinct, draw(st.integers(1, 12))))
    rng.shuffle(spec)
    return spec


def _min_blocks(spec, block_size: int) -> int:
    # Enough for the largest request at full length even without sharing (+1 for rounding
    # of a split prefix/distinct in the batchllm layout).
    return max(-(-(len(p) + m) // block_size) for p, m in spec) + 1


SETTINGS = settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(spec=workloads(), block_size=st.sampled_from([1, 4, 16]), budget=st.integers(4, 96),
       tight=st.booleans(), stop_mod=st.sampled_from([None, 5]))
def test_every_policy_same_outputs_no_leaks(spec, block_size, budget, tight, stop_mod):
    num_blocks = _min_blocks(spec, block_size) + (1 if tight else 400)
    results = {}
    for policy in POLICIES:
        config = SchedulerConfig(policy=policy, num_kv_blocks=num_blocks, block_size=block_size,
                                 max_num_batched_tokens=budget)
        outputs, _, _ = run(spec, config, stop_mod=stop_mod)
        assert sorted(outputs) == list(range(len(spec)))  # every request exactly once
        if stop_mod is None:
            assert all(len(outputs[i]) == spec[i][1] for i in range(len(spec)))
        results[policy] = outputs
    for policy in POLICIES[1:]:
        assert results[policy] == results["batchllm"], policy


def test_sglang_matches_again_after_evictions():
    """A request admitted earlier in a step may evict cached blocks that a later one matched at
    the start of the step (here request 4's block of token 3, cached by request 1): the later
    one matches again when admitted, so it never reads a block that another request rewrote."""
    spec = [([1, 0], 2), ([3, 1], 1), ([1, 4, 4, 3, 3], 2), ([1, 5], 2), ([3, 4, 1], 1)]
    results = {}
    for policy in ("batchllm", "sglang"):
        config = SchedulerConfig(policy=policy, num_kv_blocks=9, block_size=1, max_num_batched_tokens=3)
        results[policy], _, _ = run(spec, config)
    assert results["sglang"] == results["batchllm"]


@SETTINGS
@given(spec=workloads(), block_size=st.sampled_from([1, 4, 16]), budget=st.integers(4, 64),
       threshold=st.sampled_from([0.6, 0.8, 1.0]), reserve=st.sampled_from([0.0, 0.3, 1.0]))
def test_batchllm_memory_never_above_threshold(spec, block_size, budget, threshold, reserve):
    need = _min_blocks(spec, block_size) + 1
    num_blocks = int(need / threshold) + 2
    config = SchedulerConfig(policy="batchllm", num_kv_blocks=num_blocks, block_size=block_size,
                             max_num_batched_tokens=budget, kv_memory_threshold=threshold,
                             decode_reserve_ratio=reserve)
    outputs, sched, stats = run(spec, config)
    assert stats["max_used"] <= sched.threshold_blocks
    assert all(len(outputs[i]) == spec[i][1] for i in range(len(spec)))
    reference, _, _ = run(spec, SchedulerConfig(policy="simple", num_kv_blocks=num_blocks * 4, block_size=block_size,
                                                max_num_batched_tokens=budget))
    assert outputs == reference


def _micro_spec(prefix, distinct, sd, num_requests, max_tokens, seed=0):
    rng = random.Random(seed)
    spec = []
    for g in range(num_requests // sd):
        p = [1000 + g] + [rng.randrange(1000, 30000) for _ in range(prefix - 1)]
        for m in range(sd):
            spec.append((p + [500 + m] + [rng.randrange(1000, 30000) for _ in range(distinct - 1)], max_tokens))
    rng.shuffle(spec)
    return spec


def test_severe_memory_pressure_forces_preemption_outputs_unchanged():
    spec = _micro_spec(48, 8, 4, 32, 24)
    block_size = 4
    tiny = _min_blocks(spec, block_size) + 2
    outputs = {}
    preempted = {}
    for policy in POLICIES:
        for reserve in ([1.0, 0.0] if policy == "batchllm" else [1.0]):
            config = SchedulerConfig(policy=policy, num_kv_blocks=tiny, block_size=block_size,
                                     max_num_batched_tokens=32, decode_reserve_ratio=reserve)
            outputs[policy, reserve], _, stats = run(spec, config)
            preempted[policy, reserve] = stats["preemptions"]
    first = outputs["batchllm", 1.0]
    assert all(o == first for o in outputs.values())
    # Tiny memory does force preemptions (reservation off, and the per-request baselines).
    assert preempted["batchllm", 0.0] > 0 and preempted["vllm", 1.0] > 0
    assert preempted["batchllm", 1.0] == 0  # full reservation: admitted requests always finish


def test_prefix_chunk_before_members_and_groups_adjacent():
    spec = _micro_spec(40, 6, 4, 16, 3)
    config = SchedulerConfig(policy="batchllm", num_kv_blocks=500, block_size=4, max_num_batched_tokens=50)
    requests = _requests(spec)
    sched = make_scheduler(config)
    sched.add_requests(requests)
    saw_same_step = False
    while sched.has_unfinished():
        out = sched.schedule()
        groups_with_prefix = {c.group_id for c in out.chunks if c.is_prefix}
        saw_same_step |= any(not c.is_prefix and c.group_id in groups_with_prefix for c in out.chunks)
        finish = {}
        for c in out.chunks:
            if c.sample:
                requests[c.seq_id].output_token_ids.append(7)
                if len(requests[c.seq_id].output_token_ids) >= requests[c.seq_id].max_tokens:
                    finish[c.seq_id] = "length"
        sched.update(out, finish)
    # The checker (other tests) proves the ordering; here: a prefix and its first distinct
    # chunks do share a step (prefix processed no later than its first distinct chunk).
    assert saw_same_step


@pytest.mark.parametrize("policy", POLICIES)
def test_group_members_see_shared_prefix_via_shared_kv_len(policy):
    spec = _micro_spec(33, 5, 3, 9, 2)  # prefix not block aligned: no copy-on-write needed
    config = SchedulerConfig(policy=policy, num_kv_blocks=300, block_size=4, max_num_batched_tokens=64)
    outputs, sched, stats = run(spec, config)
    assert len(outputs) == 9
    if policy == "batchllm":
        assert stats["prefix_freed"] >= 3


def test_checker_rejects_a_row_whose_fixed_fields_change():
    """The runner keeps shared_kv_len, group_id and is_prefix per row: they may change only
    after the row is dropped (a preemption or a finish)."""
    from batchllm.sched.checker import ContractError
    from batchllm.sched.interface import ScheduledChunk, SchedulerOutput

    checker = ChunkStreamChecker([SchedRequest(0, [1, 2, 3, 4, 5], 4)], block_size=4)
    first = ScheduledChunk(seq_id=0, token_ids=(1, 2, 3, 4), start_position=0, num_tokens=4, new_block_ids=(7,))
    checker.check_step(SchedulerOutput(0, (first,)))
    moved = ScheduledChunk(seq_id=0, token_ids=(5,), start_position=4, num_tokens=1, new_block_ids=(8,), block_ids_start=1,
                           group_id=3, sample=True)
    with pytest.raises(ContractError, match="changed from"):
        checker.check_step(SchedulerOutput(1, (moved,)))
    again = ScheduledChunk(seq_id=0, token_ids=(1, 2, 3, 4, 5), start_position=0, num_tokens=5, new_block_ids=(8, 9),
                           group_id=3, sample=True)
    checker.check_step(SchedulerOutput(2, (again,), preempted_request_ids=(0,)))  # a new row: accepted
