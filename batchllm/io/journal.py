"""Crash-safe journal of a batch job's output records (`OUTPUT.partial`), and the final output
file built from it. Format, resume rules and durability: docs/design.md, "Crash-safe jobs". Torch-free.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from batchllm.io.job_io import AppendFile, JobFileError, file_operation, fsync_directory, read_at, remove, replace
from batchllm.io.output_check import DUPLICATE_CODE, OutputCheckError, check_output_file

MAGIC = b"#batchllm-journal v3\t"
_OLD_MAGIC = b"#batchllm-journal v"
_ENGINE_TAG = b"#engine\t"  # a line with what the loaded engine settled (see record_engine)
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
    labels: dict = field(default_factory=dict, compare=False)  # the option each key comes from, for messages
    # keys that only the engine's records depend on: they may change while no engine has run
    engine_keys: frozenset = field(default_factory=frozenset, compare=False)

    def to_bytes(self) -> bytes:
        return MAGIC + json.dumps({"job": self.job}, sort_keys=True, ensure_ascii=True).encode("ascii") + b"\n"

    def differences(self, other: dict, ignored: frozenset = frozenset()) -> list[str]:
        """'option old -> new' for each option that differs from `other` (a decoded header job)."""
        mine = json.loads(json.dumps(self.job))
        names = sorted((set(mine) | set(other)) - ignored)
        return [f"{self.labels.get(name, name)} {other.get(name)!r} -> {mine.get(name)!r}"
                for name in names if other.get(name) != mine.get(name)]


@dataclass(frozen=True)
class ResumeReport:
    num_entries: int  # entries kept from an earlier run (one per line; checked against the input later)
    num_torn_bytes: int  # bytes cut off the end (a torn last line)
    num_corrupt_lines: int  # lines dropped from the middle
    num_superseded: int = 0  # entries for a line that a later entry answers again (the last one stands)
    num_out_of_range: int = 0  # entries for a line number the input does not have (dropped)


class Journal:
    """Append-only record log. Per input line it keeps one `_LINE` entry (22 bytes): where the
    record that answers the line is, whether it is an error record, the line's digest and state.
    Every file operation goes through batchllm.io.job_io: a fault raises JobFileError."""

    def __init__(self, path: str, header: JournalHeader, restart: bool = False,
                 num_input_lines: int | None = None) -> None:
        self.path = path
        self._num_input_lines = num_input_lines
        self._unsynced = 0
        self._last_sync = time.monotonic()
        self.num_changed = 0  # entries dropped because their input line changed
        self.engine_settings: dict | None = None  # what an earlier run's engine settled (record_engine)
        self._reset()
        if restart or not os.path.lexists(path) or not self._load(header):
            self._create(header)
        self._file = AppendFile.open_existing(path)

    def _reset(self) -> None:
        self._lines = np.zeros(1024, _LINE)  # indexed by line number, grown by doubling
        self.engine_settings = None
        self.resume = ResumeReport(0, 0, 0)

    def _create(self, header: JournalHeader) -> None:
        """A fresh journal holding only the header, put in place atomically."""
        self._reset()
        tmp_path = self.path + ".tmp"
        tmp = AppendFile.create(tmp_path)
        try:
            tmp.write(header.to_bytes())
            tmp.sync()
        finally:
            tmp.close(sync=False)
        replace(tmp_path, self.path)
        fsync_directory(self.path)

    # -- resume -----------------------------------------------------------------------------

    def _load(self, header: JournalHeader) -> bool:
        """Read an earlier run's journal; False if it holds nothing to resume (then a fresh one
        is created)."""
        with file_operation("read", self.path), open(self.path, "rb") as handle:
            first = handle.readline()
            if not first.endswith(b"\n") and (MAGIC.startswith(first) or first.startswith(MAGIC)):
                return False  # empty, or torn while it was created: nothing was recorded
            old = _decode_header(self.path, first)
            bad, num_entry_lines, num_superseded, num_out_of_range = self._read_entries(handle, len(first))
            end = handle.tell()
        # no engine ran yet: its records (bad lines) depend on none of the engine's options
        ignored = header.engine_keys if self.engine_settings is None else frozenset()
        differences = header.differences(old, ignored)
        if differences:
            if num_entry_lines or bad:
                raise JournalMismatchError(
                    f"{self.path} was written by a job with other options ({'; '.join(differences)}): resume "
                    "with the earlier options, or add --restart to start over")
            return False  # no record was made with the other options: start afresh
        torn, num_corrupt = 0, 0
        if header.differences(old):  # only engine options differ, and no engine ran: take this run's
            num_corrupt = len(bad)
            self._rewrite(header)
        elif len(bad) == 1 and sum(bad[0]) == end:  # only the last line is torn: cut it off
            torn = bad[0][1]
            with file_operation("truncate", self.path):
                fd = os.open(self.path, os.O_WRONLY)
                try:
                    os.ftruncate(fd, bad[0][0])
                    os.fsync(fd)
                finally:
                    os.close(fd)
        elif bad:
            num_corrupt = len(bad)
            self._rewrite()
        self.resume = ResumeReport(int(np.count_nonzero(self._lines["state"] == _LOADED)), torn, num_corrupt,
                                   num_superseded, num_out_of_range)
        return True

    def _read_entries(self, handle, offset: int, out: AppendFile | None = None) -> tuple[list, int, int, int]:
        """Remember the entries of the lines left in handle, the first at byte `offset`; with
        `out`, copy the good lines there (offsets then count in the copy). Returns the (offset,
        length) of torn or corrupt lines, and the numbers of entry lines, superseded entries and
        out-of-range entries."""
        bad: list[tuple[int, int]] = []
        num_entry_lines = num_superseded = num_out_of_range = 0
        for raw in handle:
            start = offset if out is None else out.tell()
            if raw.startswith(_ENGINE_TAG):
                settings = _parse_engine(raw)
                if settings is None:
                    bad.append((offset, len(raw)))
                else:
                    self.engine_settings = settings
                    if out is not None:
                        out.write(raw)
                offset += len(raw)
                continue
            entry = _parse_entry(raw)
            if entry is None:
                bad.append((offset, len(raw)))
            elif self._num_input_lines is not None and entry[0] > self._num_input_lines:
                num_out_of_range += 1
            else:
                num_entry_lines += 1
                num_superseded += self._remember_loaded(entry, start)
                if out is not None:
                    out.write(raw)
            offset += len(raw)
        return bad, num_entry_lines, num_superseded, num_out_of_range

    def _remember_loaded(self, entry: tuple[int, int, bool, int, int, bool], offset: int) -> bool:
        """Remember one entry; True if it supersedes an earlier entry for its line. A later run
        appends an entry only for a line it did not keep, so the last entry of a line stands; a
        duplicate_custom_id record is never final (a resume decides duplicates again)."""
        line_number, digest, is_error, record_start, record_length, final = entry
        superseded = line_number < self._lines.size and self._lines["state"][line_number] != _NONE
        if final:
            self._set_line(line_number, (offset + record_start, record_length, is_error, digest, _LOADED))
        elif superseded:
            self._lines["state"][line_number] = _NONE
        return superseded

    def _rewrite(self, header: JournalHeader | None = None) -> None:
        """Drop corrupt lines: copy the good entries to a fresh file (and remember them anew),
        under `header` if given (else the old one)."""
        tmp_path = self.path + ".tmp"
        self._lines = np.zeros(1024, _LINE)
        self.engine_settings = None
        out = AppendFile.create(tmp_path)
        try:
            with file_operation("read", self.path), open(self.path, "rb") as handle:
                first = handle.readline()
                out.write(header.to_bytes() if header is not None else first)
                self._read_entries(handle, out.tell(), out)
            out.sync()
        finally:
            out.close(sync=False)
        replace(tmp_path, self.path)
        fsync_directory(self.path)

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

    def record_engine(self, settings: dict) -> None:
        """Journal what the engine settled when it loaded (its dtype, the token limit a request
        may hold), durably, before any record that depends on it."""
        self._file.write(_ENGINE_TAG + json.dumps(settings, sort_keys=True).encode("ascii") + b"\n")
        self.sync()
        self.engine_settings = json.loads(json.dumps(settings))

    def append(self, line_number: int, record: dict, record_json: str, digest: int = 0) -> None:
        """Journal one output record (record_json = its serialised form, one line) answering
        input line `line_number`, whose bytes have digest64 `digest`."""
        prefix = b"%d\t%016x\t" % (line_number, digest & 0xFFFFFFFFFFFFFFFF)
        data = record_json.encode("utf-8")
        offset = self._file.tell() + len(prefix)
        self._file.write(prefix + data + b"\n")
        self._set_line(line_number, (offset, len(data), record.get("error") is not None, digest, _KEPT))
        self._unsynced += 1
        self.maybe_sync()

    def maybe_sync(self) -> None:
        if self._unsynced and (self._unsynced >= SYNC_EVERY_RECORDS
                               or time.monotonic() - self._last_sync >= SYNC_EVERY_SECONDS):
            self.sync()

    def sync(self) -> None:
        self._file.sync()
        self._unsynced = 0
        self._last_sync = time.monotonic()

    def flush_for_exit(self) -> None:
        """Best effort, from any thread, before the process exits at once (a second signal)."""
        with contextlib.suppress(JobFileError, OSError):
            if not self._file.closed and not self._file.broken:
                self._file.sync()

    def close(self) -> None:
        """Sync and close (a file that failed is closed without writing more)."""
        self._file.close(sync=True)

    @property
    def broken(self) -> bool:
        return self._file.broken

    # -- counts and the final file ----------------------------------------------------------

    def counts(self, confirmed_only: bool = True) -> tuple[int, int]:
        """(answered, errors): one per input line, confirmed in this run (or, with
        confirmed_only=False, also the earlier run's entries not checked yet)."""
        states = (_KEPT,) if confirmed_only else (_KEPT, _LOADED)
        is_error = self._lines["error"][np.isin(self._lines["state"], states)]
        return int(is_error.size - is_error.sum()), int(is_error.sum())

    def finalize(self, output_path: str, order: str = "input", errors_path: str | None = None,
                 num_input_records: int | None = None) -> None:
        """Write the output file (order "input" or "finish") and the errors file, if any,
        atomically, after checking them (one record per input line with a record, no custom_id
        twice); then remove the journal. num_input_records: the input's lines with a record."""
        self.close()
        num_answered, num_errors = self.counts()
        if num_input_records is not None and num_answered + num_errors != num_input_records:
            raise OutputCheckError(f"{self.path} answers {num_answered + num_errors} of the "
                                   f"{num_input_records} input lines with a record")
        paths = [output_path] + ([errors_path] if errors_path else [])
        tmp_paths = [path + ".tmp" for path in paths]
        try:
            with contextlib.ExitStack() as stack:
                outs = []
                for tmp_path in tmp_paths:
                    outs.append(AppendFile.create(tmp_path))
                    stack.callback(outs[-1].close, sync=False)
                with file_operation("open", self.path):
                    fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
                stack.callback(os.close, fd)
                for record, is_error in self._records(fd, order):
                    for out in outs[:1 + is_error]:  # an error record goes to the errors file too
                        out.write(record + b"\n")
                for out in outs:
                    out.sync()
            check_output_file(tmp_paths[0], num_answered + num_errors)
            if errors_path:
                check_output_file(tmp_paths[1], num_errors)
            for tmp_path, path in reversed(list(zip(tmp_paths, paths))):  # the output last
                replace(tmp_path, path)
        except BaseException:
            for tmp_path in tmp_paths:
                with contextlib.suppress(JobFileError):
                    remove(tmp_path)
            raise
        fsync_directory(output_path)
        remove(self.path)

    def _records(self, fd: int, order: str) -> Iterator[tuple[bytes, bool]]:
        """(record bytes, is_error) of each confirmed line, in the chosen order."""
        lines = self._lines[self._lines["state"] == _KEPT]  # in input order
        if order == "finish":  # journal order
            lines = lines[np.argsort(lines["offset"], kind="stable")]
        for offset, length, is_error in zip(lines["offset"].tolist(), lines["length"].tolist(),
                                            lines["error"].tolist()):
            yield read_at(fd, self.path, offset, length), is_error


def _decode_header(path: str, first: bytes) -> dict:
    if first.startswith(_OLD_MAGIC) and not first.startswith(MAGIC):
        raise JournalMismatchError(f"{path} was written by an older batchllm (another journal format): "
                                   "add --restart to start over")
    if not first.startswith(MAGIC) or not first.endswith(b"\n"):
        raise JournalMismatchError(f"{path} is not a batchllm journal: remove it or run with --restart")
    try:
        old = json.loads(first[len(MAGIC):])["job"]
    except (ValueError, KeyError, TypeError):
        raise JournalMismatchError(f"{path} has a damaged header: add --restart to start over") from None
    return old if isinstance(old, dict) else {}


def _parse_engine(raw: bytes) -> dict | None:
    if not raw.endswith(b"\n"):
        return None
    try:
        settings = json.loads(raw[len(_ENGINE_TAG):])
    except ValueError:
        return None
    return settings if isinstance(settings, dict) else None


def _parse_entry(raw: bytes) -> tuple[int, int, bool, int, int, bool] | None:
    """(line number, line digest, is_error, record offset in raw, record length, final), or
    None if torn/corrupt. final: False for a duplicate_custom_id record."""
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
    error = record["error"]
    final = not (isinstance(error, dict) and error.get("code") == DUPLICATE_CODE)
    return line_number, digest, error is not None, second + 1, len(raw) - second - 2, final
