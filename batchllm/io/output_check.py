"""The last check before a job reports success: its output file, read back from disk, holds
exactly one record per input line and no custom_id twice. Torch-free."""

from __future__ import annotations

import json

from batchllm.io.compact_set import Int64Set, digest64
from batchllm.io.job_io import file_operation

DUPLICATE_CODE = "duplicate_custom_id"  # such a record names an id that an earlier line holds


class OutputCheckError(RuntimeError):
    """The output file does not hold what the input asks for (a bug: it is not put in place)."""


def check_output_file(path: str, num_records: int) -> None:
    """Raise OutputCheckError unless path holds num_records JSON records, each with custom_id
    and error, and no usable custom_id (a non-blank string) on two records other than
    duplicate_custom_id ones."""
    seen = Int64Set()
    count = 0
    with file_operation("read back", path), open(path, "rb") as handle:
        for raw in handle:
            count += 1
            try:
                record = json.loads(raw)
            except ValueError:
                raise OutputCheckError(f"record {count} of {path!r} is not JSON") from None
            if not isinstance(record, dict) or "custom_id" not in record or "error" not in record:
                raise OutputCheckError(f"record {count} of {path!r} has no custom_id or error")
            custom_id, error = record["custom_id"], record["error"]
            if isinstance(error, dict) and error.get("code") == DUPLICATE_CODE:
                continue
            usable = isinstance(custom_id, str) and custom_id.strip()
            if usable and not seen.add(digest64(custom_id.encode("utf-8", "surrogatepass"))):
                raise OutputCheckError(f"custom_id {custom_id!r} is on two records of {path!r}")
    if count != num_records:
        raise OutputCheckError(f"{path!r} holds {count} records for {num_records} input lines")
