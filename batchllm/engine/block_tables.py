"""The runner's persistent block tables: one host row per live sequence, changed in place by
each step's block-table changes (sched/interface.py), gathered per step."""

from __future__ import annotations

import numpy as np

from batchllm.sched.interface import SchedulerOutput


class BlockTableRows:
    """Rows of a host int32 table keyed by seq id through a free-row list; rows and columns
    grow by doubling. Entries past a row's length are 0 (a step's gathered table is
    zero-padded, as the attention kernels expect)."""

    def __init__(self, num_rows: int = 256, num_cols: int = 64) -> None:
        self.table = np.zeros((num_rows, num_cols), dtype=np.int32)
        self._num_blocks: list[int] = [0] * num_rows  # row length
        self._row_of: dict[int, int] = {}
        self._free_rows: list[int] = list(range(num_rows - 1, -1, -1))

    @property
    def num_live_rows(self) -> int:
        return len(self._row_of)

    def step_tables(self, output: SchedulerOutput) -> np.ndarray:
        """Apply the step's changes; its block tables [num_chunks, max_blocks] int32 (a copy)."""
        rows, max_blocks = self.apply(output)
        return self.table[rows, :max(max_blocks, 1)]

    def apply(self, output: SchedulerOutput) -> tuple[np.ndarray, int]:
        """Apply the step's changes; returns (the row of each chunk, the longest of those rows)."""
        if output.step_index == 0:
            self.clear()  # a new scheduler: no row survives from an earlier run
        for seq_id in output.dropped_seq_ids:
            row = self._row_of.pop(seq_id, None)
            if row is not None:
                self.table[row, :self._num_blocks[row]] = 0
                self._num_blocks[row] = 0
                self._free_rows.append(row)
        rows = []
        max_blocks = 0
        num_blocks = self._num_blocks
        for chunk in output.chunks:
            row = self._row_of.get(chunk.seq_id)
            if row is None:
                row = self._new_row(chunk.seq_id)
            start, new_block_ids = chunk.block_ids_start, chunk.new_block_ids
            if new_block_ids or start != num_blocks[row]:
                self._set(row, start, new_block_ids)
            rows.append(row)
            max_blocks = max(max_blocks, num_blocks[row])
        return np.array(rows, dtype=np.intp), max_blocks

    def clear(self) -> None:
        self.table[:] = 0
        self._num_blocks = [0] * self.table.shape[0]
        self._row_of.clear()
        self._free_rows = list(range(self.table.shape[0] - 1, -1, -1))

    def _set(self, row: int, start: int, new_block_ids: tuple[int, ...]) -> None:
        old_end = self._num_blocks[row]
        if start > old_end:
            raise ValueError(f"block-table change starts at {start}, the row has {old_end} blocks")
        end = start + len(new_block_ids)
        if end > self.table.shape[1]:
            self._grow(self.table.shape[0], max(end, 2 * self.table.shape[1]))
        self.table[row, start:end] = new_block_ids
        if end < old_end:
            self.table[row, end:old_end] = 0
        self._num_blocks[row] = end

    def _new_row(self, seq_id: int) -> int:
        if not self._free_rows:
            num_rows = self.table.shape[0]
            self._grow(2 * num_rows, self.table.shape[1])
            self._num_blocks += [0] * num_rows
            self._free_rows = list(range(2 * num_rows - 1, num_rows - 1, -1))
        row = self._free_rows.pop()
        self._row_of[seq_id] = row
        return row

    def _grow(self, num_rows: int, num_cols: int) -> None:
        table = np.zeros((num_rows, num_cols), dtype=np.int32)
        table[:self.table.shape[0], :self.table.shape[1]] = self.table
        self.table = table
