"""The tensor-parallel control plane: every rank schedules for itself, and a gate in shared memory
keeps the ranks on the same steps (docs/scale-out.md, "Tensor parallelism").

Every rank runs the same scheduler on the same requests and samples from the same gathered
logits, so every rank makes the same steps with no per-step messages. Rank 0 (the leader) never
waits on the gate: it writes "step g is launched, with this fingerprint" and goes on. A worker
(a follower) launches step g only after the leader has, for two reasons:
- a run the leader ends early (an exception, or a caller that stops reading outputs) must end at
  the same step on every rank, or a worker's collectives would wait for a partner forever;
- the fingerprint check turns a divergent schedule into an error instead of wrong output.

The leader is at most a step or two ahead (it waits for each step's collectives before reading its
tokens), so a worker usually finds its step opened already; it polls shared memory, no syscall.

Shared int64 words: [OPENED, STOP, FP ring, END_TAG ring, END_STEP ring]. Step numbers g count
every step of the engine's life (global, across runs), so a step never names two runs.
"""

from __future__ import annotations

import os
import time

import numpy as np

RING = 64  # steps (and runs) the leader may be ahead of a follower
_OPENED, _STOP, _FP, _END_TAG, _END_STEP = 0, 1, 2, 2 + RING, 2 + 2 * RING
NUM_WORDS = 2 + 3 * RING
_MASK = (1 << 62) - 1


class RunAborted(Exception):
    """The leader ended the run before this step (a follower ends its run here)."""


class ScheduleDivergedError(RuntimeError):
    """A follower's step differs from the leader's: a bug that would give wrong tokens."""


def step_fingerprint(run_id: int, output) -> int:
    """A number that differs, almost surely, between two different scheduled steps."""
    chunks = output.chunks
    num_tokens = sum(chunk.num_tokens for chunk in chunks)
    return hash((run_id, output.step_index, len(chunks), num_tokens, sum(chunk.seq_id for chunk in chunks))) & _MASK


def new_shared_words(context):
    """The gate's shared memory, from a multiprocessing context (passed to spawned workers)."""
    words = context.RawArray("q", NUM_WORDS)
    view = np.frombuffer(words, dtype=np.int64)
    view[:] = -1
    view[_STOP] = 0
    return words


class StepGate:
    """One rank's side of the gate: pass_step() before every step (the leader opens it, a
    follower waits for it); end_run() and stop() are the leader's."""

    def __init__(self, words, leader: bool, timeout_s: float = 600.0) -> None:
        self.words = np.frombuffer(words, dtype=np.int64)
        self.leader = leader
        self.timeout_s = timeout_s
        self.next_step = 0  # this rank's global step number
        self._parent_pid = os.getppid()

    def pass_step(self, run_id: int, fingerprint: int) -> None:
        """Before a step's first collective: the leader opens it, a follower waits for it."""
        if self.leader:
            step = self.next_step
            self.words[_FP + step % RING] = fingerprint
            self.words[_OPENED] = step
        else:
            self._wait(run_id, fingerprint)
        self.next_step += 1

    def end_run(self, run_id: int) -> None:
        """Leader: run_id launched no step after the last opened one."""
        slot = run_id % RING
        self.words[_END_STEP + slot] = self.next_step - 1
        self.words[_END_TAG + slot] = run_id

    def stop(self) -> None:
        """Leader: no more steps at all (shutdown)."""
        self.words[_STOP] = 1

    def _wait(self, run_id: int, fingerprint: int) -> None:
        step, words = self.next_step, self.words
        started = time.monotonic()
        polls = 0
        while True:
            if words[_END_TAG + run_id % RING] == run_id and words[_END_STEP + run_id % RING] < step:
                raise RunAborted(f"run {run_id} ended before step {step}")
            if words[_OPENED] >= step:
                self._check(step, fingerprint)
                return
            if words[_STOP]:
                raise RunAborted("the engine is shutting down")
            polls += 1
            if polls > 200:  # a step the leader has not reached yet: stop spinning
                time.sleep(min(1e-3, 1e-5 * (polls - 200)))
                if polls % 1000 == 0:
                    self._check_alive(started)

    def _check(self, step: int, fingerprint: int) -> None:
        # On a weakly ordered CPU the fingerprint may become visible after the step number.
        deadline = time.monotonic() + 1.0
        while self.words[_FP + step % RING] != fingerprint:
            if time.monotonic() > deadline:
                raise ScheduleDivergedError(
                    f"step {step}: this rank scheduled {fingerprint}, rank 0 {int(self.words[_FP + step % RING])}")
            time.sleep(1e-5)

    def _check_alive(self, started: float) -> None:
        if os.getppid() != self._parent_pid:
            raise RuntimeError("tensor parallel rank 0 exited")
        if time.monotonic() - started > self.timeout_s:
            raise RuntimeError(f"tensor parallel rank 0 opened no step for {self.timeout_s:.0f} s")
