"""stdout and stderr that a closed reader cannot turn into a crash: `batchllm run ... | head`
must finish its job. After the first write that finds the pipe closed, that stream's file
descriptor is pointed at /dev/null (so the interpreter's last flush is silent too) and the
rest of its output is dropped (Python's documented way to handle SIGPIPE, per stream)."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import sys
from collections.abc import Iterator

_CLOSED_ERRNOS = (errno.EPIPE, errno.EBADF)


class PipeSafeStream:
    """Wraps a text stream: writes after its reader went away are dropped."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self.reader_gone = False

    def write(self, text: str) -> int:
        if not self.reader_gone:
            with self._dropping_if_closed():
                return self._stream.write(text)
        return len(text)

    def flush(self) -> None:
        if not self.reader_gone:
            with self._dropping_if_closed():
                self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    @contextlib.contextmanager
    def _dropping_if_closed(self) -> Iterator[None]:
        try:
            yield
        except OSError as error:
            if error.errno not in _CLOSED_ERRNOS:
                raise
            self.reader_gone = True
            with contextlib.suppress(OSError, ValueError, io.UnsupportedOperation):
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, self._stream.fileno())
                os.close(devnull)


@contextlib.contextmanager
def pipe_safe_std_streams() -> Iterator[None]:
    """sys.stdout and sys.stderr wrapped in PipeSafeStream while the block runs (a stream that is
    None, its descriptor closed at start, becomes one that drops everything)."""
    saved = sys.stdout, sys.stderr
    sinks = []
    wrapped = []
    for stream in saved:
        if stream is None:
            stream = open(os.devnull, "w", encoding="utf-8")
            sinks.append(stream)
        wrapped.append(PipeSafeStream(stream))
    sys.stdout, sys.stderr = wrapped
    try:
        yield
    finally:
        for stream in wrapped:
            stream.flush()
        sys.stdout, sys.stderr = saved
        for sink in sinks:
            sink.close()
