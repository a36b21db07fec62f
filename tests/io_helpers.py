"""Plain helpers for the input-parsing tests (torch-free)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from batchllm.io.batch_input import BatchError, BatchRequest, parse_line
from batchllm.io.compact_set import Int64Set


def parse_lines(lines: Iterable[bytes | str], start_line: int = 1) -> Iterator[BatchRequest | BatchError]:
    """Parse JSONL lines; blank lines are skipped; duplicate custom_ids are errors."""
    seen = Int64Set()
    for line_number, raw in enumerate(lines, start=start_line):
        item = parse_line(raw, line_number, seen)
        if item is not None:
            yield item
