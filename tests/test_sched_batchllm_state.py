"""The batchllm policy keeps running totals and sets instead of re-scanning its members each step:
after every schedule() and update() they equal a recount from the members' state, under
admission deferral, preemption of members and groups, and early stops."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz import examples

from batchllm.sched.config import SchedulerConfig
from batchllm.sched.factory import make_scheduler
from batchllm.sched.interface import SchedRequest
from batchllm.sched.policies.batchllm import BatchLLMScheduler, _fills_blocks
from batchllm.sched.policies.batchllm_state import RANK_SHIFT


def _recount(sched: BatchLLMScheduler) -> None:
    members, pool, size = sched.members, sched.pool, sched.block_size
    running, waiting, committed = set(), set(), pool.num_used_blocks
    for group in sched.active_groups:
        committed += pool.blocks_for_tokens(len(group.prefix_token_ids)) - len(group.prefix_block_ids)
        work = set()
        for slot in group.members:
            if members.finished[slot]:
                continue
            num_own = int(members.num_own_prompt_tokens[slot] + members.num_outputs[slot])
            pending = num_own - int(members.num_computed_tokens[slot])
            decoding = members.num_outputs[slot] > 0 and pending == 1
            if members.waiting[slot]:
                waiting.add(slot)
                work.add(slot)
                continue
            running.add(slot)
            reserved = num_own - int(members.num_outputs[slot]) + int(members.reserved_decode_tokens[slot])
            committed += max(0, -(-max(num_own, reserved) // size) - int(members.num_blocks[slot]))
            if pending > 0 and not decoding:
                work.add(slot)
            assert int(members.key[slot]) == (group.rank << RANK_SHIFT) + int(members.index[slot])
        assert group.work == work
        assert (group.rank in sched._with_work) == bool(work)
        assert (group.rank in sched._prefix_pending) == (not group.prefix_done)
    assert set(members.running[:members.size].nonzero()[0].tolist()) == running
    assert set(members.waiting[:members.size].nonzero()[0].tolist()) == waiting
    assert (sched._num_running, sched._num_waiting) == (len(running), len(waiting))
    assert sched._committed_blocks() == committed
    num_blocks = members.num_blocks[:members.size]
    assert (num_blocks == -(-members.num_computed_tokens[:members.size] // size)).all()
    assert (num_blocks <= members.block_region_size[:members.size]).all()
    held = np.concatenate([members.own_blocks(s) for s in range(members.size)] + [np.zeros(0, dtype=np.int64)])
    assert np.unique(held).shape == held.shape and sched.pool._held[held].all()
    order = sched._running_slots().tolist()
    assert order == sorted(running, key=lambda s: int(members.key[s]))


@st.composite
def _workloads(draw):
    rng = random.Random(draw(st.integers(0, 2**31 - 1)))
    spec = []
    for _ in range(draw(st.integers(1, 6))):
        prefix = [rng.randrange(20) for _ in range(draw(st.integers(0, 30)))]
        for _ in range(draw(st.integers(1, 6))):
            spec.append((prefix + [rng.randrange(20) for _ in range(draw(st.integers(1, 12)))],
                         draw(st.integers(1, 10))))
    rng.shuffle(spec)
    return spec


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=_workloads(), block_size=st.sampled_from([1, 3, 4]), budget=st.integers(2, 40),
       spare_blocks=st.integers(0, 12), reserve=st.sampled_from([0.0, 0.5, 1.0]), stop_mod=st.sampled_from([None, 4]))
def test_running_totals_equal_a_recount(spec, block_size, budget, spare_blocks, reserve, stop_mod):
    need = max(-(-(len(p) + m) // block_size) for p, m in spec) + 2
    config = SchedulerConfig(policy="batchllm", num_kv_blocks=need + spare_blocks, block_size=block_size,
                             max_num_batched_tokens=budget, decode_reserve_ratio=reserve)
    sched = make_scheduler(config)
    requests = [SchedRequest(i, list(prompt), max_tokens) for i, (prompt, max_tokens) in enumerate(spec)]
    sched.add_requests(requests)
    for _ in range(5000):
        if not sched.has_unfinished():
            break
        output = sched.schedule()
        _recount(sched)
        reasons = {}
        chunks = output.chunks
        for seq_id in chunks.seq_ids[chunks.sample].tolist():
            request = requests[seq_id]
            token = (seq_id * 31 + len(request.output_token_ids)) % 9
            request.output_token_ids.append(token)
            if len(request.output_token_ids) >= request.max_tokens:
                reasons[seq_id] = "length"
            elif stop_mod and token % stop_mod == 0:
                reasons[seq_id] = "stop"
        sched.update(output, reasons)
        _recount(sched)
    assert not sched.has_unfinished()
    assert sched.pool.num_free_blocks == sched.pool.num_blocks


def _decode_steps(sched: BatchLLMScheduler, requests: list[SchedRequest], num_steps: int, recount: bool) -> list:
    """Steps whose finishes are never read (every request keeps decoding past max_tokens); request
    0's block table after each."""
    rows = []
    for _ in range(num_steps):
        output = sched.schedule()
        for seq_id in output.chunks.seq_ids[output.chunks.sample].tolist():
            requests[seq_id].output_token_ids.append(9)
        sched.update(output, {})
        if recount:
            _recount(sched)
        rows.append(sched.block_table(0))
    return rows


def test_fills_blocks_for_any_block_size():
    num_tokens = np.arange(200, dtype=np.int64)
    for block_size in range(1, 40):
        assert (_fills_blocks(num_tokens, block_size) == (num_tokens % block_size == 0)).all(), block_size


def test_a_member_scheduled_past_its_full_length_moves_its_blocks_to_a_larger_region():
    config = SchedulerConfig(policy="batchllm", num_kv_blocks=64, block_size=4, max_num_batched_tokens=64)
    sched = make_scheduler(config)
    requests = [SchedRequest(0, [1, 2, 3, 4, 5, 6], 2, share_prefix=False), SchedRequest(1, [7, 8], 1)]
    sched.add_requests(requests)
    slot = sched._slot_of[0]
    region_size = int(sched.members.block_region_size[slot])
    rows = _decode_steps(sched, requests, 8, recount=True)
    assert int(sched.members.num_blocks[slot]) > region_size
    assert all(row == rows[-1][:len(row)] for row in rows)  # blocks only appended, none lost in the moves
    assert len(rows[-1]) == -(-(6 + 8) // 4)


def test_a_long_output_grows_its_region_from_the_first_outputs_and_keeps_every_block():
    config = SchedulerConfig(policy="batchllm", num_kv_blocks=8192, block_size=16, max_num_batched_tokens=64)
    sched = make_scheduler(config)
    requests = [SchedRequest(0, [1, 2, 3, 4, 5, 6], 100_000, share_prefix=False)]
    sched.add_requests(requests)
    slot = sched._slot_of[0]
    # the prompt's and 1024 outputs' 65 blocks, not max_tokens' 6,251
    assert int(sched.members.block_region_size[slot]) == -(-(6 + 1024) // 16)
    rows = _decode_steps(sched, requests, 1500, recount=False)
    assert int(sched.members.block_region_size[slot]) > -(-(6 + 1024) // 16)
    assert all(row == rows[-1][:len(row)] for row in rows)  # blocks only appended, none lost in the move
    assert len(rows[-1]) == -(-(6 + 1500) // 16)
