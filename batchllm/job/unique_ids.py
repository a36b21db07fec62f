"""custom_ids are unique across the whole input file, valid lines or not: the first line with an
id stands (answered, or its own error), and every later line with that id becomes a
duplicate_custom_id error. Decided again from the input on every run, so a resume after an edit
never keeps an answer for a line that is now a duplicate, nor a duplicate error for a line that
is now unique. Torch-free."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from batchllm.io.batch_input import BatchError, BatchRequest
from batchllm.io.compact_set import Int64Set, digest64
from batchllm.io.output_check import DUPLICATE_CODE


def first_line_wins(items: Iterable[BatchRequest | BatchError]) -> Iterator[BatchRequest | BatchError]:
    """items with every line after the first of a usable custom_id (a non-blank string) turned
    into a duplicate_custom_id error. Memory: a 64-bit digest per id (compact_set.Int64Set)."""
    seen = Int64Set()
    for item in items:
        custom_id = item.custom_id
        if isinstance(custom_id, str) and custom_id.strip():
            first = seen.add(digest64(custom_id.encode("utf-8", "surrogatepass")))
            if not first and not (isinstance(item, BatchError) and item.code == DUPLICATE_CODE):
                item = BatchError(item.line_number, DUPLICATE_CODE,
                                  f"custom_id {custom_id!r} already used on an earlier line", custom_id, item.digest)
        yield item
