"""The files of one batch job, checked before any work, and the lock that makes it the only
writer of its output (docs/design.md, "Crash-safe jobs"). Torch-free.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time


class JobFilesError(ValueError):
    """A path of the job cannot be used; the message names the fix."""


def journal_path_for(output_path: str) -> str:
    return output_path + ".partial"


def lock_path_for(output_path: str) -> str:
    return output_path + ".lock"


def _same_file(a: str, b: str) -> bool:
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _check_writable_file(path: str, flag: str, input_path: str) -> None:
    if os.path.isdir(path):
        raise JobFilesError(f"{flag} {path!r} is a directory (fix: name a file, e.g. "
                            f"{os.path.join(path, 'out.jsonl')!r})")
    if _same_file(path, input_path):
        raise JobFilesError(f"{flag} {path!r} is the input file (fix: choose another {flag} path)")
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.probe")
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        os.remove(probe)
    except OSError as error:
        raise JobFilesError(f"cannot write {flag} {path!r}: {error.strerror or error} "
                            f"(fix: choose a writable {flag} path)") from None


def check_job_paths(input_path: str, output_path: str, errors_path: str | None) -> None:
    """Raise JobFilesError if the job's output or errors path cannot be used (see the module doc)."""
    _check_writable_file(output_path, "-o", input_path)
    for derived in (journal_path_for(output_path), lock_path_for(output_path), output_path + ".tmp"):
        if _same_file(derived, input_path):
            raise JobFilesError(f"the input file is {derived!r}, a file this job writes (fix: rename the input)")
    if errors_path is not None:
        _check_writable_file(errors_path, "--errors", input_path)
        if os.path.abspath(errors_path) == os.path.abspath(output_path) or _same_file(errors_path, output_path):
            raise JobFilesError(f"--errors {errors_path!r} is the output file (fix: choose another --errors path)")


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
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                os.close(fd)
                if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise JobLockedError(self._held_message()) from None
            if self._still_linked(fd):
                break
            os.close(fd)  # the holder removed the file between our open and flock: retry
        holder = {"pid": os.getpid(), "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
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
        fresh file), then unlock."""
        if self._fd is None:
            return
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> JobLock:
        return self.acquire()
