"""The runner's persistent batch: one host row per live sequence, kept from step to step
(docs/design.md, "Block tables travel as changes"). A step's changes are applied as array
operations over its chunk columns: no Python work per row but for rows made or dropped."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchllm.sched.interface import SchedulerOutput


@dataclass(frozen=True)
class StepRows:
    """The rows of one step's chunks, in chunk order (copies)."""

    batch_rows: np.ndarray  # [num_chunks] int64: each chunk's row in the persistent batch
    block_tables: np.ndarray  # [num_chunks, max_blocks] int32, zero-padded
    shared_kv_lens: np.ndarray  # [num_chunks] int64
    group_ids: np.ndarray  # [num_chunks] int32
    is_prefix: np.ndarray  # [num_chunks] bool


class BatchRows:
    """Rows keyed by seq id (a sorted id array searched per step) through a free-row list; rows
    and table columns grow by doubling."""

    def __init__(self, num_rows: int = 256, num_cols: int = 64) -> None:
        self._reset(num_rows, num_cols)

    @property
    def num_rows(self) -> int:
        """Rows the batch has room for (a row index is below it)."""
        return self.table.shape[0]

    @property
    def num_live_rows(self) -> int:
        """Sequences that hold a row."""
        return int(self._ids.shape[0])

    def _reset(self, num_rows: int, num_cols: int) -> None:
        self.table = np.zeros((num_rows, num_cols), dtype=np.int32)
        self.shared_kv_lens = np.zeros(num_rows, dtype=np.int64)
        self.group_ids = np.zeros(num_rows, dtype=np.int32)
        self.is_prefix = np.zeros(num_rows, dtype=bool)
        self._num_blocks = np.zeros(num_rows, dtype=np.int64)  # row length
        self._ids = np.zeros(0, dtype=np.int64)  # live seq ids, sorted
        self._id_rows = np.zeros(0, dtype=np.int64)  # the row of each
        self._free_rows: list[int] = list(range(num_rows - 1, -1, -1))

    def step_rows(self, output: SchedulerOutput) -> StepRows:
        """Apply the step's changes; the rows of its chunks."""
        if output.step_index == 0:
            self._reset(*self.table.shape)  # a new scheduler: no row survives from an earlier run
        if output.dropped_seq_ids:
            self._drop(np.array(output.dropped_seq_ids, dtype=np.int64))
        chunks = output.chunks
        rows = self._find(chunks.seq_ids)
        new = rows < 0
        if new.any():
            rows[new] = self._new_rows(np.flatnonzero(new), output)
        self._apply_changes(rows, output)
        max_blocks = int(self._num_blocks[rows].max()) if rows.size else 0
        return StepRows(rows, self.table[rows, :max(max_blocks, 1)], self.shared_kv_lens[rows], self.group_ids[rows],
                        self.is_prefix[rows])

    def _find(self, seq_ids: np.ndarray) -> np.ndarray:
        """The row of each seq id, -1 for one without a row."""
        ids = self._ids
        if not ids.size:
            return np.full(seq_ids.shape[0], -1, dtype=np.int64)
        place = np.minimum(np.searchsorted(ids, seq_ids), ids.shape[0] - 1)
        return np.where(ids[place] == seq_ids, self._id_rows[place], -1)

    def _drop(self, seq_ids: np.ndarray) -> None:
        rows = self._find(seq_ids)
        known = rows >= 0
        seq_ids, rows = seq_ids[known], rows[known]
        if not rows.size:
            return
        self.table[rows] = 0
        self._num_blocks[rows] = 0
        self._free_rows.extend(rows.tolist())
        keep = ~np.isin(self._ids, seq_ids)
        self._ids, self._id_rows = self._ids[keep], self._id_rows[keep]

    def _new_rows(self, chunk_indices: np.ndarray, output: SchedulerOutput) -> np.ndarray:
        """Rows for the chunks at chunk_indices (sequences without one), in chunk order; each row
        keeps the fields its first chunk gives (fixed while the sequence has a row)."""
        num_new = chunk_indices.shape[0]
        while len(self._free_rows) < num_new:
            num_rows = self.table.shape[0]
            self._grow(2 * num_rows, self.table.shape[1])
            self._free_rows = list(range(2 * num_rows - 1, num_rows - 1, -1)) + self._free_rows
        rows = np.array([self._free_rows.pop() for _ in range(num_new)], dtype=np.int64)
        chunks = output.chunks
        self.shared_kv_lens[rows] = chunks.shared_kv_lens[chunk_indices]
        self.group_ids[rows] = chunks.group_ids[chunk_indices]
        self.is_prefix[rows] = chunks.is_prefix[chunk_indices]
        seq_ids = chunks.seq_ids[chunk_indices]
        order = np.argsort(seq_ids, kind="stable")
        place = np.searchsorted(self._ids, seq_ids[order])
        self._ids = np.insert(self._ids, place, seq_ids[order])
        self._id_rows = np.insert(self._id_rows, place, rows[order])
        return rows

    def _apply_changes(self, rows: np.ndarray, output: SchedulerOutput) -> None:
        """Each chunk's change: row[block_ids_start:] = its new block ids."""
        chunks = output.chunks
        starts, counts = chunks.block_ids_start, chunks.num_new_block_ids
        old_ends = self._num_blocks[rows]
        changed = (counts > 0) | (starts != old_ends)
        if not changed.any():
            return
        if (starts > old_ends).any():
            index = int(np.argmax(starts > old_ends))
            raise ValueError(f"block-table change starts at {int(starts[index])}, the row has "
                             f"{int(old_ends[index])} blocks")
        ends = starts + counts
        if int(ends.max()) > self.table.shape[1]:
            self._grow(self.table.shape[0], max(int(ends.max()), 2 * self.table.shape[1]))
        total = int(counts.sum())
        if total:
            offsets = chunks.new_block_offsets
            columns = np.arange(total) + np.repeat(starts - offsets[:-1], counts)
            self.table[np.repeat(rows, counts), columns] = chunks.new_block_ids
        for row, end, old_end in zip(rows[ends < old_ends].tolist(), ends[ends < old_ends].tolist(),
                                     old_ends[ends < old_ends].tolist()):
            self.table[row, end:old_end] = 0  # the row got shorter
        self._num_blocks[rows[changed]] = ends[changed]

    def _grow(self, num_rows: int, num_cols: int) -> None:
        num_old_rows, num_old_cols = self.table.shape
        self.table = np.pad(self.table, ((0, num_rows - num_old_rows), (0, num_cols - num_old_cols)))
        for name in ("shared_kv_lens", "group_ids", "is_prefix", "_num_blocks"):
            setattr(self, name, np.pad(getattr(self, name), (0, num_rows - num_old_rows)))
