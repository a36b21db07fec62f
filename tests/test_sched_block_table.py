"""Block tables sent as changes: the exact changes of small schedules with a preemption, and
the rebuilt tables equal the scheduler's own tables on random workloads, for every policy."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz import examples

from batchllm.sched.block_table import BlockTableTracker
from batchllm.sched.config import SchedulerConfig
from batchllm.sched.factory import make_scheduler
from batchllm.sched.interface import ScheduledChunk, SchedRequest, SchedulerOutput

POLICIES = ("batchllm", "vllm", "sglang", "simple")
PREFIX = [1, 2, 3, 4, 5, 6]
SMALL_SPEC = [(PREFIX + [10], 6), (PREFIX + [11, 12], 6), ([20, 21, 22], 6)]


def _steps(policy: str, spec, on_step=None, **config):
    """Run with a fixed fake token; yields (output, full tables) per step."""
    requests = [SchedRequest(i, list(prompt), max_tokens) for i, (prompt, max_tokens) in enumerate(spec)]
    scheduler = make_scheduler(SchedulerConfig(policy=policy, **config))
    scheduler.add_requests(requests)
    tracker = BlockTableTracker()
    while scheduler.has_unfinished():
        output = scheduler.schedule()
        tables = tracker.apply(output)
        if on_step is not None:
            on_step(scheduler, output, tables)
        yield output, tables
        finish = {}
        for c in output.chunks:
            if c.sample:
                requests[c.seq_id].output_token_ids.append(7)
                if len(requests[c.seq_id].output_token_ids) >= requests[c.seq_id].max_tokens:
                    finish[c.seq_id] = "length"
        scheduler.update(output, finish)


def _changes(output) -> list:
    return [(c.seq_id, c.block_ids_start, c.new_block_ids) for c in output.chunks]


def test_batchllm_changes_with_a_member_preemption():
    steps = list(_steps("batchllm", SMALL_SPEC, num_kv_blocks=7, block_size=4, max_num_batched_tokens=16,
                        decode_reserve_ratio=0.0))
    assert [_changes(o) for o, _ in steps] == [
        [(2, 0, (0,)), (-1, 0, (1, 2)), (0, 0, (1, 2, 3)), (1, 0, (1, 2, 4))],  # prefix -1, members after it
        [(2, 1, ()), (0, 3, ()), (1, 3, ())],
        [(2, 1, (5,)), (0, 3, ()), (1, 3, ())],
        [(2, 2, ()), (0, 3, ()), (1, 3, (6,))],
        [(2, 2, ()), (0, 3, (4,))],  # request 1 preempted: its own blocks 4, 6 freed
        [(2, 2, ()), (0, 4, ())],
        [(1, 0, (1, 2, 3, 4))],  # resumed: its row re-sent whole (prefix blocks, then new own blocks)
        [(1, 4, ())],
    ]
    assert [t for _, t in steps][4] == [(0, 5), (1, 2, 3, 4)]
    assert [o.preempted_request_ids for o, _ in steps] == [(), (), (), (), (1,), (), (), ()]
    assert [o.finished_seq_ids for o, _ in steps] == [(), (), (), (), (), (), (2, 0), ()]


def test_vllm_changes_with_a_cached_block_swap_and_a_preemption():
    steps = list(_steps("vllm", SMALL_SPEC, num_kv_blocks=6, block_size=4, max_num_batched_tokens=16))
    assert [_changes(o) for o, _ in steps] == [
        [(0, 0, (0, 1)), (1, 0, (2, 3)), (2, 0, (4,))],
        # request 1's first block holds the same tokens as request 0's block 0: swapped for it
        # (block 2 freed, then taken again for its decode)
        [(0, 2, ()), (1, 0, (0, 3, 2)), (2, 1, ())],
        [(0, 2, (5,)), (1, 3, ()), (2, 1, ())],
        [(0, 3, ()), (1, 3, ())],  # request 2 preempted
        [(0, 3, ()), (1, 3, ())],
        [(0, 3, ()), (1, 3, (4,))],
        [(2, 0, (5, 4))],  # recomputed into new blocks
        [(2, 2, ())],
        [(2, 2, ())],
        [(2, 2, ())],
    ]
    assert [o.preempted_request_ids for o, _ in steps][3] == (2,)
    assert [o.finished_seq_ids for o, _ in steps][6] == (0, 1)


def _internal_tables(scheduler, output) -> list[tuple[int, ...]]:
    """Each chunk's whole block table as the scheduler holds it."""
    if hasattr(scheduler, "active_groups"):  # batchllm: prefix blocks, then the member's own
        tables = []
        groups = {group.prefix_id: group for group in scheduler.active_groups}
        for chunk in output.chunks:
            if chunk.is_prefix:
                tables.append(tuple(groups[chunk.seq_id].prefix_block_ids))
            else:
                member = scheduler._seqs[chunk.seq_id]
                tables.append(tuple(member.group.prefix_block_ids) + tuple(member.block_ids))
        return tables
    running = {seq.request.request_id: seq for seq in scheduler.running}
    return [tuple(running[chunk.seq_id].block_ids) for chunk in output.chunks]


@st.composite
def workloads(draw):
    rng = random.Random(draw(st.integers(0, 2**31 - 1)))
    spec = []
    for _ in range(draw(st.integers(1, 6))):
        prefix = [rng.randrange(30) for _ in range(draw(st.integers(0, 40)))]
        for _ in range(draw(st.integers(1, 5))):
            spec.append((prefix + [rng.randrange(30) for _ in range(draw(st.integers(1, 20)))], draw(st.integers(1, 12))))
    rng.shuffle(spec)
    return spec


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=workloads(), block_size=st.sampled_from([1, 4, 16]), budget=st.integers(4, 64),
       spare_blocks=st.sampled_from([1, 3, 300]), reserve=st.sampled_from([0.0, 1.0]))
def test_rebuilt_tables_equal_the_schedulers_own(spec, block_size, budget, spare_blocks, reserve):
    num_blocks = max(-(-(len(p) + m) // block_size) for p, m in spec) + 1 + spare_blocks
    for policy in POLICIES:
        def check(scheduler, output, tables):
            assert tables == _internal_tables(scheduler, output), (policy, output.step_index)

        for _ in _steps(policy, spec, check, num_kv_blocks=num_blocks, block_size=block_size,
                        max_num_batched_tokens=budget, decode_reserve_ratio=reserve):
            pass


def _output(step_index, *chunks, preempted=(), finished=()):
    return SchedulerOutput(step_index, tuple(chunks), preempted_request_ids=preempted, finished_seq_ids=finished)


def _chunk(seq_id, start, new):
    return ScheduledChunk(seq_id=seq_id, token_ids=(1,), start_position=0, num_tokens=1, new_block_ids=new,
                          block_ids_start=start)


def test_tracker_rules():
    tracker = BlockTableTracker()
    assert tracker.apply(_output(0, _chunk(3, 0, (7, 8)), _chunk(-1, 0, (2,)))) == [(7, 8), (2,)]
    assert tracker.apply(_output(1, _chunk(3, 1, (9, 4)))) == [(7, 9, 4)]  # in-place change + growth
    assert tracker.apply(_output(2, _chunk(3, 0, (5,)), preempted=(3,), finished=(-1,))) == [(5,)]
    assert tracker.num_rows == 1
    with pytest.raises(ValueError, match="starts at 3, the row has 1 blocks"):
        tracker.apply(_output(3, _chunk(3, 3, (1,))))
    assert tracker.apply(_output(0, _chunk(4, 0, (1,)))) == [(1,)] and tracker.num_rows == 1  # new scheduler
