"""Full block tables from the scheduler's block-table changes, in pure Python: the runner's rule
(engine/block_tables.py) for the contract checker, tests and benchmarks (docs/design.md)."""

from __future__ import annotations

from batchllm.sched.interface import SchedulerOutput


class BlockTableTracker:
    """One row (a list of block ids) per sequence, changed only by SchedulerOutputs, in order."""

    def __init__(self) -> None:
        self._rows: dict[int, list[int]] = {}

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    def apply(self, output: SchedulerOutput) -> list[tuple[int, ...]]:
        """Apply one step's changes; returns the full block table of each chunk, in chunk order."""
        if output.step_index == 0:
            self._rows.clear()  # a new scheduler: no row survives from an earlier run
        for seq_id in output.dropped_seq_ids:
            self._rows.pop(seq_id, None)
        tables = []
        for chunk in output.chunks:
            row = self._rows.get(chunk.seq_id)
            if row is None:
                row = self._rows[chunk.seq_id] = []
            if chunk.block_ids_start > len(row):
                raise ValueError(f"seq {chunk.seq_id}: block-table change starts at {chunk.block_ids_start}, "
                                 f"the row has {len(row)} blocks")
            del row[chunk.block_ids_start:]
            row.extend(chunk.new_block_ids)
            tables.append(tuple(row))
        return tables
