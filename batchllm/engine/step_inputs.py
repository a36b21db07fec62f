"""SchedulerOutput -> flat numpy arrays for one step (vectorised, host side)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from operator import attrgetter

import numpy as np

from batchllm.engine.batch_rows import BatchRows, StepRows
from batchllm.sched.interface import SchedulerOutput


@dataclass(frozen=True)
class StepInputs:
    input_ids: np.ndarray  # [num_tokens] int64; 0 at fed_rows
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    query_start_loc: np.ndarray  # [num_seqs + 1] int32
    seq_lens: np.ndarray  # [num_seqs] int32
    shared_kv_lens: np.ndarray  # [num_seqs] int32
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32
    group_ids: np.ndarray  # [num_seqs] int32
    is_prefix: np.ndarray  # [num_seqs] bool
    sample_rows: np.ndarray  # [num_samples] int64: last row of each chunk that samples
    sample_seq_ids: tuple[int, ...]  # seq id of each sample row
    sample_batch_rows: np.ndarray  # [num_samples] int64: its seq's persistent-batch row (keeps the sampled id)
    # Decode rows fed on the device: input_ids[fed_rows] = the last-token column at fed_batch_rows.
    fed_rows: np.ndarray  # [num_fed] int64
    fed_batch_rows: np.ndarray  # [num_fed] int64
    # Every seq is one query row: the attention's decode tiles and the CUDA graphs run such steps
    # (the one place this is decided).
    decode_only: bool

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def build_step_inputs(output: SchedulerOutput, block_size: int, rows: StepRows | None = None) -> StepInputs:
    """rows: the step's rows from the runner's persistent BatchRows. None: a standalone step whose
    chunks all carry whole tables (block_ids_start 0)."""
    if rows is None:
        rows = BatchRows(num_rows=max(1, len(output.chunks))).step_rows(output)
    block_tables, shared = rows.block_tables, rows.shared_kv_lens
    chunks = output.chunks
    num_seqs = len(chunks)
    # A chunk's rows are its ids, or, without ids, one decode row fed on the device from its
    # seq's last sampled token (ScheduledChunk): one pass gives both.
    q_lens = np.fromiter(map(len, map(attrgetter("token_ids"), chunks)), dtype=np.int64, count=num_seqs)
    fed = q_lens == 0
    q_lens[fed] = 1
    starts = np.fromiter(map(attrgetter("start_position"), chunks), dtype=np.int64, count=num_seqs)
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    num_fed = int(np.count_nonzero(fed))
    if num_fed == num_seqs:  # a decode step
        input_ids = np.zeros(num_tokens, dtype=np.int64)
    else:
        input_ids = np.fromiter(chain.from_iterable(map(attrgetter("token_ids"), chunks)), dtype=np.int64,
                                count=num_tokens - num_fed)
        if num_fed:
            host_ids, input_ids = input_ids, np.zeros(num_tokens, dtype=np.int64)
            input_ids[np.repeat(~fed, q_lens)] = host_ids

    seq_of_row = np.repeat(np.arange(num_seqs), q_lens)
    positions = np.arange(num_tokens) + (starts - query_start_loc[:-1])[seq_of_row]
    # KV addressing rule (sched/interface.py): new rows are past the shared prefix.
    own_positions = positions - shared[seq_of_row]
    if num_tokens and own_positions.min() < 0:
        raise ValueError("a new row lies inside its shared prefix: the scheduler broke the contract")
    num_shared_blocks = -(-shared // block_size)
    block_index = num_shared_blocks[seq_of_row] + own_positions // block_size
    if num_tokens and int(block_index.max()) >= block_tables.shape[1]:
        raise ValueError("a chunk's block table is too short for its tokens")
    slot_mapping = block_tables[seq_of_row, block_index].astype(np.int64) * block_size + own_positions % block_size

    sample_mask = np.fromiter(map(attrgetter("sample"), chunks), dtype=bool, count=num_seqs)
    sample_rows = query_start_loc[1:][sample_mask] - 1
    return StepInputs(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc.astype(np.int32),
        seq_lens=(starts + q_lens).astype(np.int32),
        shared_kv_lens=shared.astype(np.int32),
        block_tables=block_tables,
        group_ids=rows.group_ids,
        is_prefix=rows.is_prefix,
        sample_rows=sample_rows,
        sample_seq_ids=tuple(c.seq_id for c in chunks if c.sample),
        sample_batch_rows=rows.batch_rows[sample_mask],
        fed_rows=query_start_loc[:-1][fed] if num_fed < num_seqs else query_start_loc[:-1],
        fed_batch_rows=rows.batch_rows[fed] if num_fed < num_seqs else rows.batch_rows,
        decode_only=num_tokens == num_seqs,
    )
