"""The engine's one step loop: schedule -> launch -> read the sampled tokens -> update, at depth 0
(synchronous) or 1 (asynchronous scheduling): docs/design.md, "The step loop". A step's sampled
rows are read and checked as arrays (RequestColumns); Python runs per token only for the requests
that need it (stop strings, stop token ids, logprobs, a structured output's grammar)."""

from __future__ import annotations

import dataclasses
import gc
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from batchllm.engine.grammar_constraint import GrammarConstraint
from batchllm.engine.prompt_logprobs import PromptLogprobRows, prompt_logprob_entry
from batchllm.engine.request_columns import RequestColumns
from batchllm.engine.request_state import FinishedOutput, RequestState, RunStats
from batchllm.engine.step_result import StepResult
from batchllm.engine.step_runner import StepRunner
from batchllm.sched.interface import FinishedRequest, Scheduler, SchedulerOutput
from batchllm.sched.trace import StepRecord

if TYPE_CHECKING:  # xgrammar loads only for structured outputs
    from batchllm.structured.token_bitmask import TokenBitmaskFiller


@dataclass
class _Step:
    """A launched step, until its tokens are read and the scheduler is updated."""

    output: SchedulerOutput
    result: StepResult
    schedule_time_s: float
    launch_time_s: float
    sample_index: np.ndarray  # the column index of each sampled row's request
    sample_output_index: np.ndarray  # the output index each sampled row samples
    # the prompt positions scored (PromptLogprobRows), per request: (column index, first position, end)
    prompt_places: list[tuple[int, int, int]]
    read: bool = False  # its sampled ids are read (appended to the requests' outputs)
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
    stats: RunStats
    on_step: Callable[[int, int], None] | None = None
    bitmask_filler: TokenBitmaskFiller | None = None  # set when a request has a structured output
    _last_completed_s: float = 0.0
    _columns: RequestColumns | None = None

    def run(self) -> Iterator[FinishedOutput]:
        """Yields each request as it finishes. The objects alive at its start (the batch's requests
        and plan, the model) are frozen out of the cyclic garbage collector until it ends: each full
        collection would walk all of them again (one took ~0.3 s in a run of 30,000 requests)."""
        gc.freeze()
        try:
            yield from self._run()
        finally:
            gc.unfreeze()

    def _run(self) -> Iterator[FinishedOutput]:
        self._columns = RequestColumns(self.states)
        inflight: deque[_Step] = deque()
        self._last_completed_s = time.perf_counter()
        while self.scheduler.has_unfinished() or inflight:
            launched = None
            if self.scheduler.has_unfinished():
                launched = self._launch(inflight)
                inflight.append(launched)
            num_unread = self.depth if launched is not None else 0
            for step in list(inflight)[:len(inflight) - num_unread]:
                if not step.read:
                    self._read(step)
            if launched is not None:
                self._update(launched)
            while inflight and inflight[0].read and inflight[0].finished is not None:
                yield from self._complete(inflight.popleft())

    def _launch(self, inflight: deque[_Step]) -> _Step:
        started = time.perf_counter()
        output = self.scheduler.schedule()
        if output.is_empty:
            raise RuntimeError("the scheduler returned an empty step with requests left: a scheduler bug")
        scheduled = time.perf_counter()
        columns, chunks = self._columns, output.chunks
        sample = chunks.sample
        index = columns.index_of(chunks.seq_ids[sample])
        output_index = chunks.kv_lens[sample] - columns.prompt_len[index]
        constraint = None
        constrained = np.flatnonzero(columns.constrained[index])
        if constrained.size:  # structured outputs: their bitmask needs the earlier steps' tokens
            constraint = GrammarConstraint(columns, constrained, index[constrained], index.shape[0],
                                           self.bitmask_filler, partial(self._read_all, inflight))
        prompt_rows, prompt_places = self._prompt_logprob_rows(chunks)
        result = self.runner.execute(output, columns.sampling_rows(index, output_index), allow_graph=self.allow_graph,
                                     constraint=constraint, prompt_logprobs=prompt_rows)
        return _Step(output, result, scheduled - started, time.perf_counter() - scheduled, index, output_index,
                     prompt_places)

    def _prompt_logprob_rows(self, chunks) -> tuple[PromptLogprobRows | None, list[tuple[int, int, int]]]:
        """The step's rows whose logits score a prompt token of a request that asks for prompt
        logprobs: a row at position p scores prompt token p + 1 (the last prompt row samples)."""
        columns = self._columns
        if not columns.wants_prompt_logprobs.any():
            return None, []
        own = np.flatnonzero(~chunks.is_prefix)  # such requests are never in a shared prefix (PreparedRequest)
        index = columns.index_of(chunks.seq_ids[own])
        asking = np.flatnonzero(columns.wants_prompt_logprobs[index] & ~columns.finished[index])
        if not asking.size:
            return None, []
        row_starts = np.concatenate(([0], np.cumsum(chunks.num_tokens)[:-1]))
        rows, targets, places, num_top = [], [], [], 0
        for chunk, i in zip(own[asking].tolist(), index[asking].tolist()):
            state = columns.states[i]
            prompt = state.request.prompt_token_ids
            first = int(chunks.start_positions[chunk])
            end = min(first + int(chunks.num_tokens[chunk]), len(prompt) - 1)
            if end <= first:
                continue
            row = int(row_starts[chunk])
            rows.append(np.arange(row, row + end - first))
            targets.extend(prompt[first + 1:end + 1])
            places.append((i, first + 1, end + 1))
            num_top = max(num_top, state.request.params.prompt_logprobs)
        if not rows:
            return None, []
        return PromptLogprobRows(np.concatenate(rows), np.array(targets, dtype=np.int64), num_top), places

    def _read_all(self, steps: deque[_Step]) -> None:
        for step in steps:
            if not step.read:
                self._read(step)

    def _read(self, step: _Step) -> None:
        """Wait for the step's tokens (its only device sync); append them to the requests' outputs
        (where the scheduler sees them too), run the stop checks."""
        waiting = time.perf_counter()
        sampled = step.result.host_output()
        step.wait_time_s = time.perf_counter() - waiting
        step.read = True
        if step.prompt_places:
            self._read_prompt_logprobs(step)
        if sampled is None:
            return
        columns = self._columns
        token_ids = np.asarray(sampled.token_ids, dtype=np.int64)
        index = step.sample_index
        alive = ~columns.finished[index]  # a row after an early stop (or a failure) is dropped
        by_python = alive & columns.needs_python[index]
        fast = alive & ~by_python
        step.num_new_tokens += columns.read(index[fast], token_ids[fast])
        if by_python.any():
            chosen, top_ids, top_values = (t.tolist() if t is not None else None for t in (
                sampled.logprobs, sampled.top_token_ids, sampled.top_logprobs))
            for row in np.flatnonzero(by_python).tolist():
                i, token_id = int(index[row]), int(token_ids[row])
                state = columns.states[i]
                entry = None
                if state.logprobs is not None:
                    entry = partial(_logprob_entry, state.request.params.logprobs, row, token_id, chosen, top_ids,
                                    top_values)
                columns.read_one(i, token_id, entry)
                step.num_new_tokens += 1

    def _read_prompt_logprobs(self, step: _Step) -> None:
        """Attach the step's prompt logprobs to their requests (a position scored again after a
        preemption gets the same entry again)."""
        logprobs, ranks, top_values, top_ids = step.result.prompt_logprobs.host_lists()
        row = 0
        for i, first, end in step.prompt_places:
            state = self._columns.states[i]
            num_top, prompt = state.request.params.prompt_logprobs, state.request.prompt_token_ids
            for position in range(first, end):
                state.prompt_logprobs[position] = prompt_logprob_entry(num_top, prompt[position], logprobs[row],
                                                                       top_values[row], top_ids[row])
                state.prompt_token_ranks[position] = ranks[row]
                row += 1

    def _update(self, step: _Step) -> None:
        """scheduler.update for the newest step (read or not): finish the requests whose end is
        known and those whose token of this step is their max_tokens-th."""
        columns, chunks = self._columns, step.output.chunks
        index = columns.index_of(chunks.seq_ids[~chunks.is_prefix])
        reasons: dict[int, str] = {}
        for i in index[columns.finished[index]].tolist():
            reasons[int(columns.request_ids[i])] = columns.states[i].finish_reason
        sample_index = step.sample_index
        # the real reason is set once the token is read
        ending = ~columns.finished[sample_index] & (step.sample_output_index + 1 >= columns.max_tokens[sample_index])
        for request_id in columns.request_ids[sample_index[ending]].tolist():
            reasons[request_id] = "length"
        step.finished = self.scheduler.update(step.output, reasons)

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
            yield self.states.pop(done.request_id).finished_output(done)
        if self.on_step is not None:
            self.on_step(len(step.finished), step.num_new_tokens)


def _logprob_entry(num_top: int, row: int, token_id: int, chosen, top_ids, top_values) -> dict[int, float]:
    entry = {token_id: chosen[row]}
    if top_ids is not None:
        entry.update(zip(top_ids[row][:num_top], top_values[row][:num_top]))
    return entry
