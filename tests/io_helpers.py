"""Plain helpers for the input-parsing tests (torch-free)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from batchllm.io.batch_input import BatchError, BatchRequest, first_line_wins, parse_line


def parse_lines(lines: Iterable[bytes | str], start_line: int = 1) -> Iterator[BatchRequest | BatchError]:
    """Parse JSONL lines; blank lines are skipped; duplicate custom_ids are errors."""
    parsed = (parse_line(raw, line_number) for line_number, raw in enumerate(lines, start=start_line))
    return first_line_wins(item for item in parsed if item is not None)
