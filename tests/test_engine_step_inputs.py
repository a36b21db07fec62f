"""SchedulerOutput -> step arrays, including the shared-prefix KV addressing rule."""

import dataclasses

import numpy as np
import pytest

from batchllm.engine.batch_rows import BatchRows
from batchllm.engine.step_inputs import build_step_inputs
from batchllm.sched.block_table import BlockTableTracker
from batchllm.sched.config import SchedulerConfig
from batchllm.sched.factory import make_scheduler
from batchllm.sched.interface import ScheduledChunk, SchedRequest, SchedulerOutput
from batchllm.perf.workloads import micro_workload


def test_slots_positions_and_sample_rows():
    block_size = 4
    chunks = (
        # a group's prefix chunk: 6 tokens into prefix blocks 3, 5
        ScheduledChunk(seq_id=-1, token_ids=(1, 2, 3, 4, 5, 6), start_position=0, num_tokens=6,
                       new_block_ids=(3, 5), is_prefix=True, group_id=0),
        # a member: prefix of 6 shared (blocks 3,5), own tokens from position 6 in own block 9
        ScheduledChunk(seq_id=0, token_ids=(7, 8), start_position=6, num_tokens=2, new_block_ids=(3, 5, 9),
                       shared_kv_len=6, sample=True, group_id=0),
        # an ungrouped decode at position 9 in blocks 1, 2, 4 -> block index 2, offset 1; its input
        # is fed on the device from its row of the last-token column
        ScheduledChunk(seq_id=1, token_ids=(), start_position=9, num_tokens=1, new_block_ids=(1, 2, 4), sample=True,
                       is_decode=True),
    )
    inputs = build_step_inputs(SchedulerOutput(0, chunks), block_size)
    assert inputs.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 0]
    assert inputs.positions.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 9]
    assert inputs.slot_mapping.tolist() == [12, 13, 14, 15, 20, 21, 36, 37, 17]
    assert inputs.query_start_loc.tolist() == [0, 6, 8, 9]
    assert inputs.seq_lens.tolist() == [6, 8, 10]
    assert inputs.shared_kv_lens.tolist() == [0, 6, 0]
    assert inputs.sample_rows.tolist() == [7, 8]
    assert inputs.sample_seq_ids == (0, 1)
    assert inputs.sample_batch_rows.tolist() == [1, 2]  # a fresh persistent batch: rows in chunk order
    assert (inputs.fed_rows.tolist(), inputs.fed_batch_rows.tolist()) == ([8], [2])
    assert not inputs.decode_only
    assert inputs.group_ids.tolist() == [0, 0, -1]
    assert inputs.is_prefix.tolist() == [True, False, False]
    assert inputs.block_tables.tolist() == [[3, 5, 0], [3, 5, 9], [1, 2, 4]]
    assert inputs.input_ids.dtype == np.int64


def test_a_decode_only_step_is_decided_once_from_its_rows():
    """One query row per chunk, whether fed on the device or a one-token chunk with its id."""
    decode = ScheduledChunk(seq_id=0, token_ids=(), start_position=5, num_tokens=1, new_block_ids=(0, 1),
                            sample=True, is_decode=True)
    one_token = ScheduledChunk(seq_id=1, token_ids=(9,), start_position=0, num_tokens=1, new_block_ids=(2,),
                               sample=True)
    inputs = build_step_inputs(SchedulerOutput(0, (decode, one_token)), 4)
    assert inputs.decode_only
    assert inputs.input_ids.tolist() == [0, 9]
    assert (inputs.fed_rows.tolist(), inputs.fed_batch_rows.tolist()) == ([0], [0])
    two = ScheduledChunk(seq_id=1, token_ids=(9, 10), start_position=0, num_tokens=2, new_block_ids=(2,))
    assert not build_step_inputs(SchedulerOutput(0, (decode, two)), 4).decode_only


def _whole_table_step(output: SchedulerOutput, tables) -> SchedulerOutput:
    """The same step with every chunk carrying its whole table (a standalone step)."""
    chunks = tuple(dataclasses.replace(c, block_ids_start=0, new_block_ids=t) for c, t in zip(output.chunks, tables))
    return SchedulerOutput(output.step_index, chunks)


@pytest.mark.parametrize("policy", ["batchllm", "vllm", "sglang"])
def test_persistent_rows_give_the_whole_tables(policy):
    """Small starting arrays (rows and columns grow by doubling); a tight cache (preemptions). The
    rows also give every chunk's shared_kv_len, group_id and is_prefix."""
    spec = [(p.tolist(), int(m)) for p, m in zip(*_micro(seed=3))]
    requests = [SchedRequest(i, prompt, max_tokens) for i, (prompt, max_tokens) in enumerate(spec)]
    config = SchedulerConfig(policy=policy, num_kv_blocks=60, block_size=4, max_num_batched_tokens=48,
                             decode_reserve_ratio=0.0)
    scheduler = make_scheduler(config)
    scheduler.add_requests(requests)
    rows, tracker = BatchRows(num_rows=2, num_cols=2), BlockTableTracker()
    column: dict[int, int] = {}  # the last-token column: persistent row -> the id its seq sampled last
    preempted = num_fed = 0
    while scheduler.has_unfinished():
        output = scheduler.schedule()
        preempted += len(output.preempted_request_ids)
        tables = tracker.apply(output)
        inputs = build_step_inputs(output, config.block_size, rows.step_rows(output))
        expected = build_step_inputs(_whole_table_step(output, tables), config.block_size)
        for field in dataclasses.fields(expected):
            if field.name in ("sample_batch_rows", "fed_batch_rows"):
                continue  # rows of the persistent batch: below
            want, have = getattr(expected, field.name), getattr(inputs, field.name)
            assert np.array_equal(have, want) if isinstance(want, np.ndarray) else have == want, field.name
        assert len(rows._row_of) == tracker.num_rows  # finished and preempted rows dropped
        # A fed row's input is the id its own row sampled last: the request's newest output.
        fed_seq_ids = [output.chunks[i].seq_id for i in np.searchsorted(inputs.query_start_loc, inputs.fed_rows)]
        assert [column[row] for row in inputs.fed_batch_rows.tolist()] == [
            requests[i].output_token_ids[-1] for i in fed_seq_ids]
        num_fed += len(fed_seq_ids)
        finish = {}
        for seq_id, row in zip(inputs.sample_seq_ids, inputs.sample_batch_rows.tolist()):
            token = 5 + len(requests[seq_id].output_token_ids) + 100 * seq_id
            requests[seq_id].output_token_ids.append(token)
            column[row] = token
            if len(requests[seq_id].output_token_ids) >= requests[seq_id].max_tokens:
                finish[seq_id] = "length"
        scheduler.update(output, finish)
    assert preempted > 0 and num_fed > 0
    assert rows.table.shape[0] >= 8 and rows.table.shape[1] >= 8  # grew


def test_standalone_step_needs_whole_tables():
    chunk = ScheduledChunk(seq_id=0, token_ids=(1,), start_position=4, num_tokens=1, new_block_ids=(3,),
                           block_ids_start=1)
    with pytest.raises(ValueError, match="starts at 1, the row has 0 blocks"):
        build_step_inputs(SchedulerOutput(0, (chunk,)), 4)


def _micro(seed: int):
    workload = micro_workload(24, 6, 4, num_requests=16, output_num_tokens=10, seed=seed)
    return workload.prompts, workload.max_tokens
