"""The runner's persistent batch: one host row per live sequence, kept from step to step
(docs/design.md, "Block tables travel as changes")."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchllm.sched.interface import ScheduledChunk, SchedulerOutput


@dataclass(frozen=True)
class StepRows:
    """The rows of one step's chunks, in chunk order (copies)."""

    batch_rows: np.ndarray  # [num_chunks] int64: each chunk's row in the persistent batch
    block_tables: np.ndarray  # [num_chunks, max_blocks] int32, zero-padded
    shared_kv_lens: np.ndarray  # [num_chunks] int64
    group_ids: np.ndarray  # [num_chunks] int32
    is_prefix: np.ndarray  # [num_chunks] bool


class BatchRows:
    """Rows keyed by seq id through a free-row list; rows and table columns grow by doubling."""

    def __init__(self, num_rows: int = 256, num_cols: int = 64) -> None:
        self._reset(num_rows, num_cols)

    @property
    def num_rows(self) -> int:
        """Rows the batch has room for (a row index is below it)."""
        return self.table.shape[0]

    def _reset(self, num_rows: int, num_cols: int) -> None:
        self.table = np.zeros((num_rows, num_cols), dtype=np.int32)
        self.shared_kv_lens = np.zeros(num_rows, dtype=np.int64)
        self.group_ids = np.zeros(num_rows, dtype=np.int32)
        self.is_prefix = np.zeros(num_rows, dtype=bool)
        self._num_blocks = np.zeros(num_rows, dtype=np.int64)  # row length
        self._row_of: dict[int, int] = {}
        self._free_rows: list[int] = list(range(num_rows - 1, -1, -1))

    def step_rows(self, output: SchedulerOutput) -> StepRows:
        """Apply the step's changes; the rows of its chunks."""
        if output.step_index == 0:
            self._reset(*self.table.shape)  # a new scheduler: no row survives from an earlier run
        for seq_id in output.dropped_seq_ids:
            row = self._row_of.pop(seq_id, None)
            if row is not None:
                self.table[row, :self._num_blocks[row]] = 0
                self._num_blocks[row] = 0
                self._free_rows.append(row)
        rows = np.empty(len(output.chunks), dtype=np.int64)
        for index, chunk in enumerate(output.chunks):
            row = self._row_of.get(chunk.seq_id)
            if row is None:
                row = self._new_row(chunk)
            if chunk.new_block_ids or chunk.block_ids_start != self._num_blocks[row]:
                self._set(row, chunk.block_ids_start, chunk.new_block_ids)
            rows[index] = row
        max_blocks = int(self._num_blocks[rows].max()) if rows.size else 0
        return StepRows(rows, self.table[rows, :max(max_blocks, 1)], self.shared_kv_lens[rows], self.group_ids[rows],
                        self.is_prefix[rows])

    def _set(self, row: int, start: int, new_block_ids: tuple[int, ...]) -> None:
        old_end = int(self._num_blocks[row])
        if start > old_end:
            raise ValueError(f"block-table change starts at {start}, the row has {old_end} blocks")
        end = start + len(new_block_ids)
        if end > self.table.shape[1]:
            self._grow(self.table.shape[0], max(end, 2 * self.table.shape[1]))
        self.table[row, start:end] = new_block_ids
        if end < old_end:
            self.table[row, end:old_end] = 0
        self._num_blocks[row] = end

    def _new_row(self, chunk: ScheduledChunk) -> int:
        if not self._free_rows:
            num_rows = self.table.shape[0]
            self._grow(2 * num_rows, self.table.shape[1])
            self._free_rows = list(range(2 * num_rows - 1, num_rows - 1, -1))
        row = self._free_rows.pop()
        self._row_of[chunk.seq_id] = row
        self.shared_kv_lens[row], self.group_ids[row] = chunk.shared_kv_len, chunk.group_id
        self.is_prefix[row] = chunk.is_prefix
        return row

    def _grow(self, num_rows: int, num_cols: int) -> None:
        num_old_rows, num_old_cols = self.table.shape
        self.table = np.pad(self.table, ((0, num_rows - num_old_rows), (0, num_cols - num_old_cols)))
        for name in ("shared_kv_lens", "group_ids", "is_prefix", "_num_blocks"):
            setattr(self, name, np.pad(getattr(self, name), (0, num_rows - num_old_rows)))
