"""The files of one batch job, checked before any work, and the lock that makes it the only
writer of its output (docs/design.md, "Crash-safe jobs"). Torch-free.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import time
from dataclasses import dataclass

from batchllm.io.job_io import JobFileError, file_operation


class JobFilesError(ValueError):
    """A path of the job cannot be used; the message names the fix."""


def journal_path_for(output_path: str) -> str:
    return output_path + ".partial"


def lock_path_for(output_path: str) -> str:
    return output_path + ".lock"


def tmp_path_for(path: str) -> str:
    """Where a file is written before it is renamed into place."""
    return path + ".tmp"


@dataclass(frozen=True)
class JobPath:
    path: str
    role: str  # how a message names it
    flag: str | None  # the option that names it (None: the input)


def job_paths(input_path: str, output_path: str, errors_path: str | None) -> list[JobPath]:
    """Every file a job reads or writes: the input, the output and errors files and the files
    named after them."""
    journal = journal_path_for(output_path)
    paths = [JobPath(input_path, "the input file", None), JobPath(output_path, "-o", "-o"),
             JobPath(tmp_path_for(output_path), "the temporary output file of -o", "-o"),
             JobPath(journal, "the journal of -o", "-o"),
             JobPath(tmp_path_for(journal), "the temporary journal file of -o", "-o"),
             JobPath(lock_path_for(output_path), "the lock file of -o", "-o")]
    if errors_path is not None:
        paths += [JobPath(errors_path, "--errors", "--errors"),
                  JobPath(tmp_path_for(errors_path), "the temporary file of --errors", "--errors")]
    return paths


def _identities(path: str) -> set:
    """What makes two paths one file: the directory entry (its directory resolved), the file it
    resolves to, and, for an existing file, its device and inode (hard links)."""
    absolute = os.path.abspath(path)
    keys: set = {os.path.join(os.path.realpath(os.path.dirname(absolute)), os.path.basename(absolute)),
                 os.path.realpath(absolute)}
    try:
        stat = os.stat(path)
    except OSError:
        return keys
    keys.add((stat.st_dev, stat.st_ino))
    return keys


def _describe(job_path: JobPath) -> str:
    if job_path.role == job_path.flag:
        return f"{job_path.flag} {job_path.path!r}"
    return f"{job_path.path!r} ({job_path.role})"


def _clash_message(first: JobPath, second: JobPath) -> str:
    flag = second.flag
    if first.flag is None and second.role == flag:
        return f"{flag} {second.path!r} is the input file (fix: choose another {flag} path)"
    fix = f"choose another {flag} path" + (", or rename the input" if first.flag is None else "")
    return f"{_describe(second)} is the same file as {_describe(first)} (fix: {fix})"


def check_distinct_paths(input_path: str, output_path: str, errors_path: str | None) -> None:
    """Raise JobFilesError if two files of the job are one file (by resolved path or inode):
    writing one would destroy the other."""
    seen: list[tuple[JobPath, set]] = []
    for job_path in job_paths(input_path, output_path, errors_path):
        identities = _identities(job_path.path)
        for earlier, earlier_identities in seen:
            if identities & earlier_identities:
                raise JobFilesError(_clash_message(earlier, job_path))
        seen.append((job_path, identities))


def _check_writable_file(path: str, flag: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.lexists(directory):
        shown = os.path.dirname(path) or directory
        raise JobFilesError(f"{flag} {path!r}: the directory {shown!r} does not exist "
                            f"(fix: create it, e.g. mkdir -p {shown!r}, or choose another {flag} path)")
    probe = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.probe")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except OSError as error:
        code = errno.errorcode.get(error.errno, error.errno)
        raise JobFilesError(f"cannot write {flag} {path!r}: {error.strerror or error} ({code}) "
                            f"(fix: choose a writable {flag} path)") from None
    with contextlib.suppress(OSError):  # it could be created: the directory is writable
        os.remove(probe)


def _check_regular(job_path: JobPath) -> None:
    """A file the job writes must be absent, a regular file or a symlink (replaced, not
    followed): never a directory, device or pipe (renaming over /dev/null would replace it)."""
    try:
        mode = os.lstat(job_path.path).st_mode
    except OSError:
        return  # absent, or its directory is unusable (the writability check names that)
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        fix = f"choose another {job_path.flag} path"
        if job_path.role != job_path.flag:  # a file named after -o / --errors
            fix = f"remove it, or {fix}"
        raise JobFilesError(f"{_describe(job_path)} is {kind} (fix: {fix})")


def check_job_paths(input_path: str, output_path: str, errors_path: str | None) -> None:
    """Raise JobFilesError if the job's output or errors path cannot be used, if a file it
    writes exists and is no regular file, or if two of the job's files (job_paths) are one file."""
    written = job_paths(input_path, output_path, errors_path)[1:]
    for path, flag in ((output_path, "-o"), (errors_path, "--errors")):
        if path is not None and os.path.isdir(path):
            raise JobFilesError(f"{flag} {path!r} is a directory (fix: name a file, e.g. "
                                f"{os.path.join(path, 'out.jsonl')!r})")
    for job_path in written:
        _check_regular(job_path)
    _check_writable_file(output_path, "-o")
    if errors_path is not None:
        _check_writable_file(errors_path, "--errors")
    check_distinct_paths(input_path, output_path, errors_path)


def check_existing_output(output_path: str, overwrite: bool, restart: bool) -> None:
    """An existing output (or symlink) is replaced only with overwrite, or by the resume of the
    job that writes it (its journal exists and is not being discarded)."""
    if overwrite or not os.path.lexists(output_path):
        return
    if os.path.exists(journal_path_for(output_path)) and not restart:
        return
    kind = "a symlink" if os.path.islink(output_path) else "a file"
    raise JobFilesError(f"-o {output_path!r} already exists ({kind}) (fix: add --overwrite to replace it, "
                        "or choose another -o path)")


class JobLockedError(RuntimeError):
    """Another job holds the output's lock."""


class JobLock:
    """Exclusive flock on OUTPUT.lock, which holds {"pid", "started_at"} of its holder."""

    def __init__(self, output_path: str) -> None:
        self.output_path = output_path
        self.path = lock_path_for(output_path)
        self._fd: int | None = None

    def acquire(self) -> JobLock:
        while True:
            with file_operation("open the lock file", self.path):
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                os.close(fd)
                if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise JobFileError("lock", self.path, error) from error
                raise JobLockedError(self._held_message()) from None
            if self._still_linked(fd):
                break
            os.close(fd)  # the holder removed the file between our open and flock: retry
        holder = {"pid": os.getpid(), "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        try:
            with file_operation("write", self.path):
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(holder).encode(), 0)
        except JobFileError:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def _still_linked(self, fd: int) -> bool:
        try:
            path_stat = os.stat(self.path)
        except FileNotFoundError:
            return False
        fd_stat = os.fstat(fd)
        return (path_stat.st_dev, path_stat.st_ino) == (fd_stat.st_dev, fd_stat.st_ino)

    def _held_message(self) -> str:
        try:
            with open(self.path, encoding="utf-8") as handle:
                holder = json.load(handle)
            who = f"pid {holder['pid']}, started {holder['started_at']}"
        except (OSError, ValueError, KeyError, TypeError):
            who = "pid unknown"
        return (f"another batchllm job ({who}) is writing {self.output_path!r} (lock {self.path!r}): "
                "wait for it to finish, stop it, or choose another -o path")

    def __exit__(self, *exc) -> None:
        """Remove the lock file while still holding the lock (a waiting job then retries on a
        fresh file), then unlock. A lock file that cannot be removed is harmless: the next job
        takes it over."""
        if self._fd is None:
            return
        try:
            os.remove(self.path)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> JobLock:
        return self.acquire()
