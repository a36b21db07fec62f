"""Crash-safe journal of a batch job's output records (`OUTPUT.partial`), and the final output
file built from it. Format, resume rules and durability: docs/design.md, "Crash-safe jobs". Torch-free.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

MAGIC = b"#batchllm-journal v2\t"
_OLD_MAGIC = b"#batchllm-journal v"
_NONE, _LOADED, _KEPT = 0, 1, 2  # per-line state: no entry / from an earlier run, unchecked / confirmed
SYNC_EVERY_RECORDS = 64  # fsync after this many records, or SYNC_EVERY_SECONDS, whichever comes first
SYNC_EVERY_SECONDS = 1.0
_LINE = np.dtype([("offset", np.int64), ("length", np.int32), ("error", np.bool_), ("digest", np.int64),
                  ("state", np.uint8)])  # the byte offset and length of a line's record in the journal


class JournalMismatchError(ValueError):
    """The journal was written by a job with other options (or is no journal)."""


@dataclass(frozen=True)
class JournalHeader:
    job: dict  # every option that changes outputs (JSON values)

    def to_bytes(self) -> bytes:
        return MAGIC + json.dumps({"job": self.job}, sort_keys=True, ensure_ascii=True).encode("ascii") + b"\n"

    def differences(self, other: dict) -> list[str]:
        """'name: old -> new' for each option that differs from `other` (a decoded header job)."""
        mine = json.loads(json.dumps(self.job))
        names = sorted(set(mine) | set(other))
        return [f"{name} {other.get(name)!r} -> {mine.get(name)!r}"
                for name in names if other.get(name) != mine.get(name)]


@dataclass(frozen=True)
class ResumeReport:
    num_entries: int  # entries kept from an earlier run (one per line; checked against the input later)
    num_torn_bytes: int  # bytes cut off the end (a torn last line)
    num_corrupt_lines: int  # lines dropped from the middle
    num_repeated: int = 0  # entries for a line that already had one (dropped)
    num_out_of_range: int = 0  # entries for a line number the input does not have (dropped)


class Journal:
    """Append-only record log. Per input line it keeps one `_LINE` entry (22 bytes): where the
    record that answers the line is, whether it is an error record, the line's digest and state."""

    def __init__(self, path: str, header: JournalHeader, restart: bool = False,
                 num_input_lines: int | None = None) -> None:
        self.path = path
        self._num_input_lines = num_input_lines
        self._lines = np.zeros(1024, _LINE)  # indexed by line number, grown by doubling
        self._unsynced = 0
        self._last_sync = time.monotonic()
        self.num_changed = 0  # entries dropped because their input line changed
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
            _check_header(self.path, first, header)
            bad, num_repeated, num_out_of_range = self._read_entries(handle, len(first))
            end = handle.tell()
        torn, num_corrupt = 0, 0
        if len(bad) == 1 and sum(bad[0]) == end:  # only the last line is torn: cut it off
            torn = bad[0][1]
            with open(self.path, "r+b") as handle:
                handle.truncate(bad[0][0])
                handle.flush()
                os.fsync(handle.fileno())
        elif bad:
            num_corrupt = len(bad)
            self._rewrite()
        self.resume = ResumeReport(int(np.count_nonzero(self._lines["state"] == _LOADED)), torn, num_corrupt,
                                   num_repeated, num_out_of_range)

    def _read_entries(self, handle, offset: int, out=None) -> tuple[list[tuple[int, int]], int, int]:
        """Remember the entries of the lines left in handle, the first at byte `offset`; with
        `out`, copy the good lines there (offsets then count in the copy). Returns the (offset,
        length) of torn or corrupt lines, and the numbers of repeated and out-of-range entries."""
        bad: list[tuple[int, int]] = []
        num_repeated = num_out_of_range = 0
        for raw in handle:
            entry = _parse_entry(raw)
            if entry is None:
                bad.append((offset, len(raw)))
            elif self._num_input_lines is not None and entry[0] > self._num_input_lines:
                num_out_of_range += 1
            elif not self._remember_loaded(entry, offset):
                num_repeated += 1
            elif out is not None:
                out.write(raw)
            offset = offset + len(raw) if out is None else out.tell()
        return bad, num_repeated, num_out_of_range

    def _remember_loaded(self, entry: tuple[int, int, bool, int, int], offset: int) -> bool:
        line_number, digest, is_error, record_start, record_length = entry
        if line_number < self._lines.size and self._lines["state"][line_number] != _NONE:
            return False  # answered twice: the first entry stands
        self._set_line(line_number, (offset + record_start, record_length, is_error, digest, _LOADED))
        return True

    def _rewrite(self) -> None:
        """Drop corrupt lines: copy the good entries to a fresh file (and remember them anew)."""
        tmp_path = self.path + ".tmp"
        self._lines = np.zeros(1024, _LINE)
        with open(self.path, "rb") as handle, open(tmp_path, "wb") as out:
            out.write(handle.readline())
            self._read_entries(handle, out.tell(), out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp_path, self.path)

    def keep(self, line_number: int, digest: int) -> bool:
        """The job reached input line `line_number` (with this digest): True if an earlier run's
        entry answers it (the line is skipped); an entry for a changed line is dropped."""
        state = self._lines["state"]
        if line_number >= state.size or state[line_number] == _NONE:
            return False
        if state[line_number] == _KEPT:
            return True
        if int(self._lines["digest"][line_number]) == digest:
            state[line_number] = _KEPT
            return True
        state[line_number] = _NONE
        self.num_changed += 1
        return False

    def _set_line(self, line_number: int, entry: tuple) -> None:
        if line_number >= self._lines.size:
            grown = np.zeros(max(line_number + 1, 2 * self._lines.size), _LINE)
            grown[:self._lines.size] = self._lines
            self._lines = grown
        self._lines[line_number] = entry

    # -- writing ----------------------------------------------------------------------------

    def append(self, line_number: int, record: dict, record_json: str, digest: int = 0) -> None:
        """Journal one output record (record_json = its serialised form, one line) answering
        input line `line_number`, whose bytes have digest64 `digest`."""
        prefix = b"%d\t%016x\t" % (line_number, digest & 0xFFFFFFFFFFFFFFFF)
        data = record_json.encode("utf-8")
        offset = self._handle.tell() + len(prefix)
        self._handle.write(prefix + data + b"\n")
        self._set_line(line_number, (offset, len(data), record.get("error") is not None, digest, _KEPT))
        self._unsynced += 1
        self.maybe_sync()

    def maybe_sync(self) -> None:
        if self._unsynced and (self._unsynced >= SYNC_EVERY_RECORDS
                               or time.monotonic() - self._last_sync >= SYNC_EVERY_SECONDS):
            self.sync()

    def sync(self) -> None:
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._unsynced = 0
        self._last_sync = time.monotonic()

    def flush_for_exit(self) -> None:
        """Best effort, from any thread, before the process exits at once (a second signal)."""
        with contextlib.suppress(OSError, ValueError):
            self.sync()

    def close(self) -> None:
        if not self._handle.closed:
            self.sync()
            self._handle.close()

    # -- counts and the final file ----------------------------------------------------------

    def counts(self, confirmed_only: bool = True) -> tuple[int, int]:
        """(answered, errors): one per input line, confirmed in this run (or, with
        confirmed_only=False, also the earlier run's entries not checked yet)."""
        states = (_KEPT,) if confirmed_only else (_KEPT, _LOADED)
        is_error = self._lines["error"][np.isin(self._lines["state"], states)]
        return int(is_error.size - is_error.sum()), int(is_error.sum())

    def finalize(self, output_path: str, order: str = "input", errors_path: str | None = None) -> None:
        """Write the output file (order "input" or "finish") and the errors file, if any,
        atomically; then remove the journal."""
        self.close()
        paths = [output_path] + ([errors_path] if errors_path else [])
        tmp_paths = [path + ".tmp" for path in paths]
        try:
            with contextlib.ExitStack() as stack:
                journal = stack.enter_context(open(self.path, "rb"))
                outs = [stack.enter_context(open(tmp_path, "wb")) for tmp_path in tmp_paths]
                for record, is_error in self._records(journal, order):
                    for out in outs[:1 + is_error]:  # an error record goes to the errors file too
                        out.write(record + b"\n")
                for out in outs:
                    out.flush()
                    os.fsync(out.fileno())
            for tmp_path, path in reversed(list(zip(tmp_paths, paths))):  # the output last
                os.replace(tmp_path, path)
        except BaseException:
            for tmp_path in tmp_paths:
                if os.path.exists(tmp_path):
                    os.remove(tmp_path)
            raise
        _fsync_directory(output_path)
        os.remove(self.path)

    def _records(self, journal, order: str) -> Iterator[tuple[bytes, bool]]:
        """(record bytes, is_error) of each confirmed line, in the chosen order."""
        lines = self._lines[self._lines["state"] == _KEPT]  # in input order
        if order == "finish":  # journal order
            lines = lines[np.argsort(lines["offset"], kind="stable")]
        for offset, length, is_error in zip(lines["offset"].tolist(), lines["length"].tolist(),
                                            lines["error"].tolist()):
            journal.seek(offset)
            yield journal.read(length), is_error


def _check_header(path: str, first: bytes, header: JournalHeader) -> None:
    if first.startswith(_OLD_MAGIC) and not first.startswith(MAGIC):
        raise JournalMismatchError(f"{path} was written by an older batchllm (another journal format): "
                                   "add --restart to start over")
    if not first.startswith(MAGIC) or not first.endswith(b"\n"):
        raise JournalMismatchError(f"{path} is not a batchllm journal: remove it or run with --restart")
    try:
        old = json.loads(first[len(MAGIC):])["job"]
    except (ValueError, KeyError, TypeError):
        raise JournalMismatchError(f"{path} has a damaged header: add --restart to start over") from None
    differences = header.differences(old if isinstance(old, dict) else {})
    if differences:
        raise JournalMismatchError(
            f"{path} was written by a job with other options ({'; '.join(differences)}): resume with the "
            "earlier options, or add --restart to start over")


def _parse_entry(raw: bytes) -> tuple[int, int, bool, int, int] | None:
    """(line number, line digest, is_error, record offset in raw, record length), or None if
    torn/corrupt."""
    if not raw.endswith(b"\n"):
        return None
    first = raw.find(b"\t")
    second = raw.find(b"\t", first + 1)
    if first <= 0 or second != first + 17 or not raw[:first].isdigit():
        return None
    try:
        digest = int(raw[first + 1:second], 16)
        record = json.loads(raw[second + 1:])
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or "custom_id" not in record or "error" not in record:
        return None
    line_number = int(raw[:first])
    if line_number < 1:
        return None
    digest = digest - (1 << 64) if digest >= 1 << 63 else digest
    return line_number, digest, record["error"] is not None, second + 1, len(raw) - second - 2


def _fsync_directory(path: str) -> None:
    """Make the rename durable (POSIX); a no-op where directories cannot be opened."""
    with contextlib.suppress(OSError):
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
