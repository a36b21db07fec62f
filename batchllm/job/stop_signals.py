"""SIGINT / SIGTERM for a running batch job: the first stops it after the current step (exit
128 + the signal number), a second exits at once after the journal is flushed.

Python runs signal handlers only between bytecodes of the main thread, so two signals that
arrive during one long native call (a model step) would reach the handler once. The C-level
handler writes one byte per signal to the wakeup pipe (`signal.set_wakeup_fd`), and a watcher
thread counts them there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_SHUTDOWN = b"\x00"  # no signal has number 0


class StopSignals:
    """A context manager: installed on entry (in the main thread only), undone on exit. `stop` is
    a batch_job.StopRequest."""

    def __init__(self, stop) -> None:
        self.stop = stop
        self._previous_handlers: dict = {}
        self._previous_wakeup_fd = -1
        self._pipe: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        self.num_signals = 0

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self  # a library caller's thread: signals stay theirs
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._pipe = (read_fd, write_fd)
        self._previous_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        for signum in _SIGNALS:
            self._previous_handlers[signum] = signal.signal(signum, _ignore_in_python)
        self._thread = threading.Thread(target=self._watch, name="batchllm-signals", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._pipe is None:
            return
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        os.write(self._pipe[1], _SHUTDOWN)
        self._thread.join()
        for fd in self._pipe:
            os.close(fd)
        self._pipe = None

    def _watch(self) -> None:
        while True:
            data = os.read(self._pipe[0], 64)
            for signum in data:
                if signum == 0:
                    return
                self.on_signal(signum)

    def on_signal(self, signum: int) -> None:
        self.num_signals += 1
        name = signal.Signals(signum).name
        if self.num_signals == 1:
            self.stop.exit_code = 128 + signum
            self.stop.signal_name = name
            if self.stop.finalizing:
                print(f"\n{name}: every line is answered; finishing the output file "
                      "(send it again to stop at once) ...", file=sys.stderr, flush=True)
            else:
                print(f"\n{name}: stopping after the current step, saving what is done "
                      "(send it again to stop at once) ...", file=sys.stderr, flush=True)
            return
        on_exit_now = self.stop.on_exit_now
        note = on_exit_now() if on_exit_now is not None else None
        print(f"\n{name} again: stopping now" + (f"; {note}" if note else ""), file=sys.stderr, flush=True)
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
        os._exit(128 + signum)


def _ignore_in_python(signum, frame) -> None:
    """The watcher thread acts on the signal; the Python-level handler only has to exist so
    that the C-level handler writes the wakeup byte instead of the default action."""
