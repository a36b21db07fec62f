"""SchedulerOutput -> step arrays, including the shared-prefix KV addressing rule."""

import numpy as np

from batchllm.engine.step_inputs import build_step_inputs
from batchllm.sched.interface import ScheduledChunk, SchedulerOutput


def test_slots_positions_and_sample_rows():
    block_size = 4
    chunks = (
        # a group's prefix chunk: 6 tokens into prefix blocks 3, 5
        ScheduledChunk(seq_id=-1, token_ids=(1, 2, 3, 4, 5, 6), start_position=0, block_ids=(3, 5),
                       is_prefix=True, group_id=0),
        # a member: prefix of 6 shared (blocks 3,5), own tokens from position 6 in own block 9
        ScheduledChunk(seq_id=0, token_ids=(7, 8), start_position=6, block_ids=(3, 5, 9), shared_kv_len=6,
                       sample=True, group_id=0),
        # an ungrouped decode at position 9 in blocks 1, 2, 4 -> block index 2, offset 1
        ScheduledChunk(seq_id=1, token_ids=(11,), start_position=9, block_ids=(1, 2, 4), sample=True, is_decode=True),
    )
    inputs = build_step_inputs(SchedulerOutput(0, chunks), block_size)
    assert inputs.positions.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 9]
    assert inputs.slot_mapping.tolist() == [12, 13, 14, 15, 20, 21, 36, 37, 17]
    assert inputs.query_start_loc.tolist() == [0, 6, 8, 9]
    assert inputs.seq_lens.tolist() == [6, 8, 10]
    assert inputs.shared_kv_lens.tolist() == [0, 6, 0]
    assert inputs.sample_rows.tolist() == [7, 8]
    assert inputs.sample_seq_ids == (0, 1)
    assert inputs.group_ids.tolist() == [0, 0, -1]
    assert inputs.is_prefix.tolist() == [True, False, False]
    assert inputs.block_tables.tolist() == [[3, 5, 0], [3, 5, 9], [1, 2, 4]]
    assert inputs.input_ids.dtype == np.int64
