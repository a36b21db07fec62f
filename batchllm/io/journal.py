"""Crash-safe journal of a batch job's output records, and the final output file built from it.

The journal is `OUTPUT.partial`, beside the output file. Its format (version 1):

    #batchllm-journal v1<TAB>{"input_size_bytes": N, "model": "..."}
    <input line number><TAB><output record JSON>
    <input line number><TAB><output record JSON>
    ...

One line per answered request or per-line error, in the order they finished. Lines are
flushed to the OS and fsynced in small batches (every `sync_every_records` records or
`sync_every_seconds`, and on close): a SIGKILL loses at most the unflushed records, a power
loss at most the unsynced ones; both are simply recomputed on resume. `cut -f2- OUTPUT.partial`
is a valid (finish-order) output file of everything done so far.

On resume the journal is read back: a torn last line (no newline, or not JSON) is cut off,
a corrupt line elsewhere is dropped (the journal is rewritten without it), and every entry
marks (line number, custom_id) as done. At the end the records are written, in input order
(sorted by line number) or in finish order (journal order), to `OUTPUT.tmp`, fsynced and
renamed over OUTPUT (atomic), then the journal is removed. Torch-free.
"""

from __future__ import annotations

import json
import os
import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

MAGIC = b"#batchllm-journal v1\t"
_NO_CUSTOM_ID = "\x00no custom_id"  # hashing key for records without a custom_id


class JournalMismatchError(ValueError):
    """The journal was written for a different input file or model."""


@dataclass(frozen=True)
class JournalHeader:
    input_size_bytes: int
    model: str

    def to_bytes(self) -> bytes:
        body = json.dumps({"input_size_bytes": self.input_size_bytes, "model": self.model}, ensure_ascii=True)
        return MAGIC + body.encode("ascii") + b"\n"


@dataclass(frozen=True)
class ResumeReport:
    num_entries: int  # records kept from an earlier run
    num_torn_bytes: int  # bytes cut off the end (a torn last line)
    num_corrupt_lines: int  # lines dropped from the middle


class DoneSet:
    """(input line number, custom_id) pairs already journaled, in two numpy arrays indexed
    by line number (16 bytes per input line, not a Python object per pair)."""

    def __init__(self) -> None:
        self._done = np.zeros(1024, dtype=bool)
        self._key = np.zeros(1024, dtype=np.int64)

    def add(self, line_number: int, custom_id: str | None) -> None:
        if line_number >= self._done.size:
            size = max(line_number + 1, 2 * self._done.size)
            self._done = np.concatenate((self._done, np.zeros(size - self._done.size, dtype=bool)))
            self._key = np.concatenate((self._key, np.zeros(size - self._key.size, dtype=np.int64)))
        self._done[line_number] = True
        self._key[line_number] = _key(custom_id)

    def __contains__(self, item: tuple[int, str | None]) -> bool:
        line_number, custom_id = item
        return (0 <= line_number < self._done.size and bool(self._done[line_number])
                and int(self._key[line_number]) == _key(custom_id))

    @property
    def num_done(self) -> int:
        return int(self._done.sum())


def _key(custom_id: str | None) -> int:
    # Python's str hash is salted per process; the set lives in one process only.
    return hash(_NO_CUSTOM_ID if custom_id is None else custom_id)


class Journal:
    """Append-only record log. Keeps, per entry, the line number, byte offset and length of
    its record and whether it is an error (array('q'), ~25 bytes per entry)."""

    def __init__(self, path: str, header: JournalHeader, restart: bool = False,
                 sync_every_records: int = 64, sync_every_seconds: float = 1.0) -> None:
        self.path = path
        self.done = DoneSet()
        self._lines = array("q")
        self._offsets = array("q")
        self._lengths = array("q")
        self._errors = array("b")
        self._sync_every_records = sync_every_records
        self._sync_every_seconds = sync_every_seconds
        self._unsynced = 0
        self._last_sync = time.monotonic()
        self.resume = ResumeReport(0, 0, 0)
        if restart or not os.path.exists(path):
            self._handle = open(path, "wb")
            self._handle.write(header.to_bytes())
            self.sync()
        else:
            self._load(header)
            self._handle = open(path, "ab")

    # -- resume -----------------------------------------------------------------------------

    def _load(self, header: JournalHeader) -> None:
        with open(self.path, "rb") as handle:
            first = handle.readline()
            if not first.startswith(MAGIC) or not first.endswith(b"\n"):
                raise JournalMismatchError(f"{self.path} is not a batchllm journal: remove it or run with --restart")
            try:
                old = json.loads(first[len(MAGIC):])
            except ValueError:
                old = {}
            if old.get("input_size_bytes") != header.input_size_bytes or old.get("model") != header.model:
                raise JournalMismatchError(
                    f"{self.path} was written for another input or model (input {old.get('input_size_bytes')} "
                    f"bytes, model {old.get('model')!r}; now {header.input_size_bytes} bytes, {header.model!r}): "
                    "resume with the same input and --model, or add --restart to start over")
            offset = len(first)
            bad: list[tuple[int, int]] = []  # (offset, length) of torn or corrupt lines
            for raw in handle:
                entry = _parse_entry(raw)
                if entry is None:
                    bad.append((offset, len(raw)))
                else:
                    line_number, custom_id, is_error, record_start = entry
                    self._remember(line_number, custom_id, is_error, offset + record_start,
                                   len(raw) - record_start - 1)
                offset += len(raw)
        torn, num_corrupt = 0, 0
        if len(bad) == 1 and sum(bad[0]) == offset:  # only the last line is torn: cut it off
            torn = bad[0][1]
            with open(self.path, "r+b") as handle:
                handle.truncate(bad[0][0])
                handle.flush()
                os.fsync(handle.fileno())
        elif bad:
            num_corrupt = len(bad)
            self._rewrite(first)
        self.resume = ResumeReport(len(self._lines), torn, num_corrupt)

    def _rewrite(self, first: bytes) -> None:
        """Drop corrupt lines: reread the good entries and write them to a fresh file."""
        entries = []
        with open(self.path, "rb") as handle:
            handle.readline()
            for raw in handle:
                if raw.endswith(b"\n") and _parse_entry(raw) is not None:
                    entries.append(raw)
        self._lines, self._offsets, self._lengths, self._errors = array("q"), array("q"), array("q"), array("b")
        self.done = DoneSet()
        tmp_path = self.path + ".tmp"
        with open(tmp_path, "wb") as out:
            out.write(first)
            offset = len(first)
            for raw in entries:
                line_number, custom_id, is_error, record_start = _parse_entry(raw)
                self._remember(line_number, custom_id, is_error, offset + record_start, len(raw) - record_start - 1)
                out.write(raw)
                offset += len(raw)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp_path, self.path)

    def _remember(self, line_number: int, custom_id: str | None, is_error: bool, offset: int, length: int) -> None:
        self.done.add(line_number, custom_id)
        self._lines.append(line_number)
        self._offsets.append(offset)
        self._lengths.append(length)
        self._errors.append(1 if is_error else 0)

    # -- writing ----------------------------------------------------------------------------

    def append(self, line_number: int, record: dict, record_json: str) -> None:
        """Journal one output record (record_json = its serialised form, one line)."""
        prefix = b"%d\t" % line_number
        data = record_json.encode("utf-8")
        offset = self._handle.tell() + len(prefix)
        self._handle.write(prefix + data + b"\n")
        self._remember(line_number, record.get("custom_id"), record.get("error") is not None, offset, len(data))
        self._unsynced += 1
        self.maybe_sync()

    def maybe_sync(self) -> None:
        if self._unsynced and (self._unsynced >= self._sync_every_records
                               or time.monotonic() - self._last_sync >= self._sync_every_seconds):
            self.sync()

    def sync(self) -> None:
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._unsynced = 0
        self._last_sync = time.monotonic()

    def close(self) -> None:
        if not self._handle.closed:
            self.sync()
            self._handle.close()

    # -- the final file ---------------------------------------------------------------------

    @property
    def num_entries(self) -> int:
        return len(self._lines)

    @property
    def num_errors(self) -> int:
        return sum(self._errors)

    def finalize(self, output_path: str, order: str = "input", errors_path: str | None = None) -> None:
        """Write the output file (order "input" or "finish") atomically, then remove the journal."""
        self.close()
        tmp_path = output_path + ".tmp"
        errors_tmp = errors_path + ".tmp" if errors_path else None
        with open(tmp_path, "wb") as out, open(self.path, "rb") as journal:
            errors_out = open(errors_tmp, "wb") if errors_tmp else None
            try:
                for record, is_error in self._records(journal, order):
                    out.write(record + b"\n")
                    if errors_out is not None and is_error:
                        errors_out.write(record + b"\n")
            finally:
                if errors_out is not None:
                    errors_out.flush()
                    os.fsync(errors_out.fileno())
                    errors_out.close()
            out.flush()
            os.fsync(out.fileno())
        if errors_tmp:
            os.replace(errors_tmp, errors_path)
        os.replace(tmp_path, output_path)
        _fsync_directory(output_path)
        os.remove(self.path)

    def _records(self, journal, order: str) -> Iterator[tuple[bytes, bool]]:
        """(record bytes, is_error) in the chosen order; one record per input line (the first
        journaled one, should a line ever appear twice)."""
        lines = np.array(self._lines, dtype=np.int64)
        if order == "input":
            positions = np.argsort(lines, kind="stable")
            sorted_lines = lines[positions]
            keep = np.ones(lines.size, dtype=bool)
            keep[1:] = sorted_lines[1:] != sorted_lines[:-1]
            positions = positions[keep]
        elif order == "finish":
            _, first = np.unique(lines, return_index=True)
            positions = np.sort(first)
        else:
            raise ValueError(f"order must be 'input' or 'finish', got {order!r}")
        for position in positions.tolist():
            journal.seek(self._offsets[position])
            yield journal.read(self._lengths[position]), bool(self._errors[position])


def _parse_entry(raw: bytes) -> tuple[int, str | None, bool, int] | None:
    """(line number, custom_id, is_error, offset of the record in raw), or None if torn/corrupt."""
    if not raw.endswith(b"\n"):
        return None
    tab = raw.find(b"\t")
    if tab <= 0 or not raw[:tab].isdigit():
        return None
    try:
        record = json.loads(raw[tab + 1:])
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or "custom_id" not in record or "error" not in record:
        return None
    custom_id = record["custom_id"]
    return int(raw[:tab]), custom_id if isinstance(custom_id, str) else None, record["error"] is not None, tab + 1


def _fsync_directory(path: str) -> None:
    """Make the rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
