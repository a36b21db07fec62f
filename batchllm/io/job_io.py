"""Every file operation of a batch job on its own files (input, journal, output, errors, lock)
goes through here. An OSError becomes a JobFileError naming the operation, the path and the
errno: a fault of the job's files stops the job (exit 2, the journal kept for a resume), it is
never one request's answer. Torch-free.

Writes go to the file descriptor with os.write from a buffer of our own, not through Python's
buffered file objects: after a failed write or fsync it is known what was handed to the kernel,
and nothing more is written to that file (it ends at most in one torn line, which a resume cuts).
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Iterator

FLUSH_BYTES = 1 << 20  # hand the buffer to the kernel once it holds this much


class JobFileError(Exception):
    """A file of the job could not be read or written; str() names the path and the errno."""

    def __init__(self, operation: str, path: str, error: OSError | None = None, reason: str | None = None) -> None:
        self.operation, self.path = operation, path
        self.errno = error.errno if error is not None else None
        self.reason = reason or (error.strerror if error is not None and error.strerror else str(error))
        super().__init__(self.describe())

    @property
    def errno_name(self) -> str:
        return errno.errorcode.get(self.errno, str(self.errno)) if self.errno is not None else ""

    @property
    def fix(self) -> str:
        if self.errno in (errno.ENOSPC, errno.EDQUOT):
            return "free disk space"
        if self.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return "make the path writable"
        if self.errno == errno.ENOENT:
            return "check that its directory still exists"
        return "check the disk"

    def describe(self) -> str:
        code = f" ({self.errno_name})" if self.errno is not None else ""
        return f"cannot {self.operation} {self.path!r}: {self.reason}{code}"


@contextlib.contextmanager
def file_operation(operation: str, path: str) -> Iterator[None]:
    """Turn an OSError raised inside into a JobFileError for (operation, path)."""
    try:
        yield
    except JobFileError:
        raise
    except OSError as error:
        raise JobFileError(operation, path, error) from error


def replace(source: str, target: str) -> None:
    with file_operation("rename", f"{source} -> {target}"):
        os.replace(source, target)


def remove(path: str, missing_ok: bool = True) -> None:
    with file_operation("remove", path):
        try:
            os.remove(path)
        except FileNotFoundError:
            if not missing_ok:
                raise


# a directory that cannot be opened or synced on this file system: there is nothing to make durable
_NO_DIRECTORY_SYNC = (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EACCES, errno.EPERM, errno.EISDIR)


def fsync_directory(path: str) -> None:
    """Make a rename or removal in path's directory durable (POSIX). A file system that does not
    sync directories is left alone; an I/O error is a JobFileError."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError as error:
        if error.errno in _NO_DIRECTORY_SYNC:
            return
        raise JobFileError("open the directory", directory, error) from error
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in _NO_DIRECTORY_SYNC:
            raise JobFileError("sync the directory", directory, error) from error
    finally:
        os.close(fd)


class AppendFile:
    """An append-only file: write() buffers, flush() hands the buffer to the kernel (os.write),
    sync() also fsyncs. After any failure the file is `broken`: nothing more is written to it.
    flush and sync may be called from another thread (a second signal's exit)."""

    def __init__(self, path: str, fd: int, size: int) -> None:
        self.path, self._fd, self._size = path, fd, size
        self._buffer = bytearray()
        self._lock = threading.Lock()
        self.broken = False

    @classmethod
    def create(cls, path: str) -> AppendFile:
        """A new, empty file at path (an old file or symlink there is removed first, so nothing
        is written through a link)."""
        remove(path)
        with file_operation("create", path):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        return cls(path, fd, 0)

    @classmethod
    def open_existing(cls, path: str) -> AppendFile:
        with file_operation("open", path):
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            try:
                size = os.fstat(fd).st_size
            except OSError:
                os.close(fd)
                raise
        return cls(path, fd, size)

    def tell(self) -> int:
        """Bytes in the file once everything written so far is flushed."""
        return self._size

    def write(self, data: bytes) -> None:
        with self._lock:
            self._check()
            self._buffer += data
            self._size += len(data)
            if len(self._buffer) >= FLUSH_BYTES:
                self._flush_locked()

    def flush(self) -> None:
        with self._lock:
            self._check()
            self._flush_locked()

    def sync(self) -> None:
        with self._lock:
            self._check()
            self._flush_locked()
            self._guarded("sync", os.fsync, self._fd)

    def close(self, sync: bool = True) -> None:
        """Close; with sync, flush and fsync first (skipped for a broken file)."""
        if self._fd < 0:
            return
        try:
            if sync and not self.broken:
                self.sync()
        finally:
            with self._lock:
                fd, self._fd = self._fd, -1
                with contextlib.suppress(OSError):
                    os.close(fd)

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def _check(self) -> None:
        if self._fd < 0:
            raise JobFileError("write", self.path, reason="the file is closed")
        if self.broken:
            raise JobFileError("write", self.path, reason="an earlier write to it failed")

    def _flush_locked(self) -> None:
        """Hand the buffer to the kernel; a short write is continued. What a failure leaves
        unwritten is dropped: the file is broken from then on."""
        if not self._buffer:
            return
        data, self._buffer = bytes(self._buffer), bytearray()
        written = 0
        while written < len(data):
            written += self._guarded("write", os.write, self._fd, memoryview(data)[written:])

    def _guarded(self, operation: str, function, *args):
        try:
            return function(*args)
        except OSError as error:
            self.broken = True
            raise JobFileError(operation, self.path, error) from error


def read_at(fd: int, path: str, offset: int, length: int) -> bytes:
    """length bytes at offset (a short read means the file changed under the job)."""
    with file_operation("read", path):
        data = os.pread(fd, length, offset)
    if len(data) != length:
        raise JobFileError("read", path, reason=f"the file ended at byte {offset + len(data)}, "
                                                f"expected {offset + length} (it changed under the job)")
    return data
