"""The engine's one step loop: schedule -> launch -> read the sampled tokens -> update, at depth 0
(synchronous) or 1 (asynchronous scheduling): docs/design.md, "The step loop"."""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

from batchllm.engine.placeholders import placeholder_for_row
from batchllm.engine.request_state import FinishedOutput, RequestState, RunStats
from batchllm.engine.step_result import StepResult
from batchllm.engine.step_runner import StepRunner
from batchllm.sched.interface import FinishedRequest, Scheduler, SchedulerOutput
from batchllm.sched.trace import StepRecord


@dataclass
class _Step:
    """A launched step, until its tokens are read and the scheduler is updated."""

    output: SchedulerOutput
    result: StepResult
    schedule_time_s: float
    launch_time_s: float
    token_ids: list[int] | None = None  # per sampled row, once read
    token_index: list[int] | None = None  # per sampled row: its index in the request's outputs
    finished: list[FinishedRequest] | None = None  # set by the update
    num_new_tokens: int = 0
    wait_time_s: float = 0.0


@dataclass
class StepLoop:
    scheduler: Scheduler
    runner: StepRunner
    states: dict[int, RequestState]
    depth: int  # 0: synchronous, 1: asynchronous
    allow_graph: bool
    decode: Callable[[list[int]], str]
    stats: RunStats
    on_step: Callable[[int, int], None] | None = None
    # (request id, output index, token id) of placeholders read since the last update.
    _resolved: list[tuple[int, int, int]] = field(default_factory=list)
    _last_completed_s: float = 0.0

    def run(self) -> Iterator[FinishedOutput]:
        """Yields each request as it finishes."""
        inflight: deque[_Step] = deque()
        self._last_completed_s = time.perf_counter()
        while self.scheduler.has_unfinished() or inflight:
            launched = None
            if self.scheduler.has_unfinished():
                launched = self._launch(inflight[-1] if inflight else None)
                inflight.append(launched)
            num_unread = self.depth if launched is not None else 0
            for step in list(inflight)[:len(inflight) - num_unread]:
                if step.token_ids is None:
                    self._read(step)
            if launched is not None:
                self._update(launched)
            while inflight and inflight[0].token_ids is not None and inflight[0].finished is not None:
                yield from self._complete(inflight.popleft())

    def _launch(self, previous: _Step | None) -> _Step:
        started = time.perf_counter()
        output = self.scheduler.schedule()
        if output.is_empty:
            raise RuntimeError("the scheduler returned an empty step with requests left: a scheduler bug")
        scheduled = time.perf_counter()
        rows = [self.states[chunk.seq_id].sampling_row() for chunk in output.chunks if chunk.sample]
        previous_sampled = previous.result.sampled if previous is not None else None
        previous_token_ids = previous_sampled.token_ids if previous_sampled is not None else None
        result = self.runner.execute(output, rows, previous_token_ids, allow_graph=self.allow_graph)
        return _Step(output, result, scheduled - started, time.perf_counter() - scheduled)

    def _read(self, step: _Step) -> None:
        """Wait for the step's tokens (its only device sync); record them, run the stop checks."""
        waiting = time.perf_counter()
        sampled = step.result.host_output()
        step.wait_time_s = time.perf_counter() - waiting
        step.token_ids = sampled.token_ids.tolist() if sampled is not None else []
        if sampled is None:
            return
        chosen, top_ids, top_values = (t.tolist() if t is not None else None
                                       for t in (sampled.logprobs, sampled.top_token_ids, sampled.top_logprobs))
        for row, (seq_id, token_id) in enumerate(zip(step.result.seq_ids, step.token_ids)):
            state = self.states[seq_id]
            if state.finish_reason is not None:
                continue  # the row after an early stop (or a failure): dropped
            if step.token_index is not None:  # the scheduler holds a placeholder for it
                self._resolved.append((seq_id, step.token_index[row], token_id))
            entry = None
            if state.logprobs is not None:
                entry = partial(_logprob_entry, state.request.params.logprobs, row, token_id, chosen, top_ids,
                                top_values)
            state.add_token(token_id, entry)
            step.num_new_tokens += 1

    def _update(self, step: _Step) -> None:
        """scheduler.update for the newest step: real ids if read, else placeholders; finish the
        requests at max_tokens with this token and those whose end is already known."""
        sampled: dict[int, int] = {}
        reasons: dict[int, str] = {}
        token_index: list[int] = []
        for row, seq_id in enumerate(step.result.seq_ids):
            state = self.states[seq_id]
            token_index.append(state.num_scheduled_outputs)
            sampled[seq_id] = step.token_ids[row] if step.token_ids is not None else placeholder_for_row(row)
            state.num_scheduled_outputs += 1
            if state.num_scheduled_outputs >= state.stop.max_tokens:
                reasons[seq_id] = "length"  # the real reason is set once the token is read
        for chunk in step.output.chunks:
            if not chunk.is_prefix and self.states[chunk.seq_id].finish_reason is not None:
                reasons[chunk.seq_id] = self.states[chunk.seq_id].finish_reason
        step.token_index = token_index  # the placeholders' output indices, for a read after this update
        step.finished = self.scheduler.update(step.output, sampled, reasons, self._resolved)
        self._resolved = []

    def _complete(self, step: _Step) -> Iterator[FinishedOutput]:
        now = time.perf_counter()
        self.stats.num_steps += 1
        self.stats.num_output_tokens += step.num_new_tokens
        self.stats.step_records.append(dataclasses.replace(
            StepRecord.from_output(step.output, now - self._last_completed_s),
            schedule_time_s=step.schedule_time_s, launch_time_s=step.launch_time_s, wait_time_s=step.wait_time_s,
        ))
        self._last_completed_s = now
        for done in step.finished:
            yield self.states.pop(done.request_id).finished_output(done, self.decode)
        if self.on_step is not None:
            self.on_step(len(step.finished), step.num_new_tokens)


def _logprob_entry(num_top: int, row: int, token_id: int, chosen, top_ids, top_values) -> dict[int, float]:
    entry = {token_id: chosen[row]}
    if top_ids is not None:
        entry.update(zip(top_ids[row][:num_top], top_values[row][:num_top]))
    return entry
