"""A step's chunks as columns (sched/chunks.py): built, read back as ScheduledChunk objects,
reordered, merged and compared."""

from __future__ import annotations

import numpy as np
import pytest

from batchllm.sched.chunks import ChunkColumns, ChunksBuilder, ScheduledChunk, ScheduledChunks
from batchllm.sched.interface import SchedulerOutput

CHUNKS = (
    ScheduledChunk(seq_id=-1, token_ids=(1, 2, 3), start_position=0, num_tokens=3, new_block_ids=(4, 5),
                   is_prefix=True, group_id=0),
    ScheduledChunk(seq_id=7, token_ids=(), start_position=9, num_tokens=1, new_block_ids=(), block_ids_start=3,
                   shared_kv_len=3, sample=True, group_id=0, is_decode=True),
    ScheduledChunk(seq_id=8, token_ids=(6, 7), start_position=3, num_tokens=2, new_block_ids=(4, 5, 9),
                   shared_kv_len=3, sample=True, group_id=0),
    ScheduledChunk(seq_id=2, token_ids=(8,), start_position=0, num_tokens=1, new_block_ids=(11,)),
)


def test_columns_round_trip_to_chunk_objects():
    chunks = ScheduledChunks.from_chunks(CHUNKS)
    assert len(chunks) == 4
    assert chunks.seq_ids.tolist() == [-1, 7, 8, 2]
    assert chunks.token_ids.tolist() == [1, 2, 3, 6, 7, 8]
    assert chunks.num_token_ids.tolist() == [3, 0, 2, 1]
    assert chunks.new_block_ids.tolist() == [4, 5, 4, 5, 9, 11]
    assert chunks.num_new_block_ids.tolist() == [2, 0, 3, 1]
    assert chunks.kv_lens.tolist() == [3, 10, 5, 1]
    assert tuple(chunks) == CHUNKS
    assert chunks[2] == CHUNKS[2] and chunks[1:3] == CHUNKS[1:3]
    assert chunks == CHUNKS and chunks == ScheduledChunks.from_chunks(CHUNKS)
    assert chunks != ScheduledChunks.from_chunks(CHUNKS[:3])
    assert all(type(value) is int for value in (chunks[0].seq_id, chunks[0].token_ids[0], chunks[0].new_block_ids[0]))
    assert type(chunks[0].is_prefix) is bool
    assert len(ScheduledChunks.empty()) == 0 and tuple(ScheduledChunks.empty()) == ()


def test_take_keeps_each_chunks_ids_and_blocks():
    chunks = ScheduledChunks.from_chunks(CHUNKS)
    assert tuple(chunks.take(np.array([3, 0, 2]))) == (CHUNKS[3], CHUNKS[0], CHUNKS[2])
    assert tuple(chunks.take(np.array([1, 1]))) == (CHUNKS[1], CHUNKS[1])
    assert tuple(chunks.take(np.zeros(0, dtype=np.int64))) == ()


def test_chunk_columns_written_in_parts_equal_the_built_chunks():
    columns = ChunkColumns(len(CHUNKS))
    c = CHUNKS[0]
    columns.add(c.seq_id, np.array(c.token_ids), c.start_position, c.num_tokens, list(c.new_block_ids),
                c.block_ids_start, c.shared_kv_len, c.is_prefix, c.sample, c.group_id, c.is_decode)
    part = ScheduledChunks.from_chunks(CHUNKS[1:])
    rows = columns.next_rows(3, part.token_ids, part.new_block_ids)
    for name in ("seq_ids", "start_positions", "num_tokens", "block_ids_start", "shared_kv_lens", "group_ids",
                 "is_prefix", "sample", "is_decode", "num_token_ids", "num_new_block_ids"):
        getattr(columns, name)[rows] = getattr(part, name)
    assert columns.build() == CHUNKS
    unfinished = ChunkColumns(2)
    unfinished.add(1, (), 0, 1, ())
    with pytest.raises(AssertionError, match="1 of 2 chunks written"):
        unfinished.build()


def test_move_tail_places_the_last_chunks_before_the_given_ones():
    chunks = ScheduledChunks.from_chunks(CHUNKS)
    assert tuple(chunks.move_tail(np.array([0, 1]))) == (CHUNKS[2], CHUNKS[0], CHUNKS[3], CHUNKS[1])
    assert tuple(chunks.move_tail(np.array([2]))) == (CHUNKS[0], CHUNKS[1], CHUNKS[3], CHUNKS[2])
    assert tuple(chunks.move_tail(np.array([3]))) == CHUNKS  # after the last of the others
    assert tuple(chunks.move_tail(np.zeros(0, dtype=np.int64))) == CHUNKS


def test_builder_and_scheduler_output_counts():
    builder = ChunksBuilder()
    for c in CHUNKS:
        builder.add(c.seq_id, c.token_ids, c.start_position, c.num_tokens, c.new_block_ids, c.block_ids_start,
                    c.shared_kv_len, c.is_prefix, c.sample, c.group_id, c.is_decode)
    assert len(builder) == 4
    output = SchedulerOutput.from_chunks(3, builder.build(), num_running_requests=3, num_used_blocks=5)
    assert (output.num_decode_tokens, output.num_prefix_tokens, output.num_distinct_tokens) == (1, 3, 3)
    assert output.num_tokens == 7 and not output.is_empty
    # A plain sequence of chunks is converted; the two outputs compare equal.
    assert SchedulerOutput(3, CHUNKS, 1, 3, 3, 3, 5) == output
    with pytest.raises(TypeError):
        hash(output.chunks)
