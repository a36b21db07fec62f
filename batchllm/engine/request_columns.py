"""The step loop's view of a run's requests as columns (one numpy entry per request), so that a
step's sampled tokens are read, and max_tokens / EOS checked, with array operations. A request
whose tokens need Python (stop strings, stop token ids, logprobs, a structured output's grammar) goes through its RequestState
one token at a time, as every request once did (docs/design.md, "The step loop")."""

from __future__ import annotations

from collections import deque

import numpy as np

from batchllm.engine.request_state import RequestState
from batchllm.engine.sampler import sampling_row
from batchllm.engine.sampling_rows import NO_LOGPROBS, PenaltyRows, SamplingRows
from batchllm.engine.stop_checker import StopChecker

# The sampling row of a request whose row could not be built: greedy, no logprobs (its tokens are
# dropped, the request is finished with an error).
_NEUTRAL = (0.0, 1.0, -1, 0.0, 0, 0, None, None)


class RequestColumns:
    """Per request, in request id order: the prompt length, max_tokens, tokens read, whether it is
    finished (its RequestState's finish_reason is set), whether its tokens need Python, whether
    EOS stops it, and its fixed sampling settings."""

    def __init__(self, states: dict[int, RequestState]) -> None:
        ids = np.fromiter(states, dtype=np.int64, count=len(states))
        order = np.argsort(ids, kind="stable")
        self.request_ids = ids[order]
        self._contiguous = not ids.size or int(self.request_ids[-1]) - int(self.request_ids[0]) == ids.size - 1
        self.states: list[RequestState] = [states[i] for i in self.request_ids.tolist()]
        num = len(self.states)
        self.outputs = np.empty(num, dtype=object)  # each request's output_token_ids list
        self.prompt_len = np.zeros(num, dtype=np.int64)
        self.max_tokens = np.zeros(num, dtype=np.int64)
        self.num_read = np.zeros(num, dtype=np.int64)
        self.finished = np.zeros(num, dtype=bool)
        self.needs_python = np.zeros(num, dtype=bool)
        self.constrained = np.zeros(num, dtype=bool)  # a structured output: its grammar masks its rows
        self.wants_prompt_logprobs = np.zeros(num, dtype=bool)  # its prompt rows are scored too
        self.stop_on_eos = np.zeros(num, dtype=bool)
        eos = self.states[0].stop.eos_token_ids if self.states else frozenset()
        self.eos_token_ids = np.array(sorted(eos), dtype=np.int64)
        rows = []
        for i, state in enumerate(self.states):
            params = state.request.params
            self.outputs[i] = state.output_token_ids
            self.prompt_len[i] = len(state.request.prompt_token_ids)
            self.max_tokens[i] = state.stop.max_tokens
            self.num_read[i] = len(state.output_token_ids)
            self.stop_on_eos[i] = not params.ignore_eos
            self.constrained[i] = state.grammar is not None
            self.wants_prompt_logprobs[i] = state.prompt_logprobs is not None
            self.needs_python[i] = bool(state.logprobs is not None or params.stop or params.stop_token_ids
                                        or state.grammar is not None
                                        or state.stop.eos_token_ids != eos or type(state.stop) is not StopChecker)
            rows.append(self._static_row(state))
            self.finished[i] = state.finish_reason is not None
        self._sampling = SamplingRows.from_tuples(rows)
        self._bias = np.zeros(num, dtype=bool)
        self._bias[self._sampling.logit_bias_rows] = True
        self.penalty_slots = PenaltySlots(self.states, self.finished, self.eos_token_ids)

    @staticmethod
    def _static_row(state: RequestState) -> tuple:
        """Its sampling row (output index 0); a neutral one, the request failed, if that fails."""
        try:
            return sampling_row(state.request.params, state.seed, 0)
        except Exception as error:  # noqa: BLE001 - finish this request only
            state.fail(error)
            return _NEUTRAL

    def index_of(self, request_ids: np.ndarray) -> np.ndarray:
        """The column index of each request id."""
        ids = self.request_ids
        if self._contiguous:  # ids first .. first + n - 1 (the usual case): no search
            index = request_ids - ids[0] if ids.size else request_ids
            if index.size and (index.min() < 0 or index.max() >= ids.shape[0]):
                raise KeyError("a scheduled request id is not one of this run's requests")
            return index
        index = np.searchsorted(self.request_ids, request_ids)
        if index.size and (index.max() >= self.request_ids.shape[0]
                           or not np.array_equal(self.request_ids[index], request_ids)):
            raise KeyError("a scheduled request id is not one of this run's requests")
        return index

    def sampling_rows(self, index: np.ndarray, output_index: np.ndarray) -> SamplingRows:
        """The rows of requests `index` sampling their output_index-th tokens."""
        rows = self._sampling
        biased = np.flatnonzero(self._bias[index])
        if biased.size:
            place = np.searchsorted(rows.logit_bias_rows, index[biased])
            logit_bias = tuple(rows.logit_bias[p] for p in place.tolist())
        else:
            logit_bias = ()
        return SamplingRows(rows.temperature[index], rows.top_p[index], rows.top_k[index], rows.min_p[index],
                            rows.seeds[index], output_index, rows.logprobs[index], biased, logit_bias,
                            self.penalty_slots.rows(index, output_index))

    def asks_logprobs(self, index: np.ndarray) -> bool:
        return bool((self._sampling.logprobs[index] != NO_LOGPROBS).any())

    def read(self, index: np.ndarray, token_ids: np.ndarray) -> int:
        """Append each token to its request's outputs and finish the requests it ends (EOS or
        max_tokens), for requests whose tokens need no Python; returns how many were read."""
        if not index.size:
            return 0
        deque(map(list.append, self.outputs[index], token_ids.tolist()), maxlen=0)
        self.num_read[index] += 1
        stop = self.stop_on_eos[index] & np.isin(token_ids, self.eos_token_ids)
        if self.penalty_slots.min_tokens is not None:  # no EOS stop before min_tokens tokens
            stop &= self.num_read[index] >= self.penalty_slots.min_tokens[index]
        ended = stop | (self.num_read[index] >= self.max_tokens[index])
        for i, is_stop in zip(index[ended].tolist(), stop[ended].tolist()):
            self.states[i].finish_reason = "stop" if is_stop else "length"
            self.finished[i] = True
        return int(index.shape[0])

    def fail(self, i: int, message: str) -> None:
        """Finish request i (only) with an error; its later rows are dropped."""
        state = self.states[i]
        state.error, state.finish_reason = message, "error"
        self.finished[i] = True

    def read_one(self, i: int, token_id: int, logprob_entry) -> None:
        """One token of a request whose tokens need Python: RequestState.add_token."""
        state = self.states[i]
        state.add_token(token_id, logprob_entry)
        self.num_read[i] += 1
        self.finished[i] = state.finish_reason is not None


class PenaltySlots:
    """The requests' penalties and min_tokens as columns, and the slots of the device's count table
    (engine/penalties.py): a penalised request takes a slot when it first samples and holds it
    until it finishes (a recomputed request keeps its counts: its replayed tokens are not sampled
    again). A finished request's slot is taken back when a new one is needed, so the table holds
    as many slots as penalised requests run at once."""

    def __init__(self, states: list[RequestState], finished: np.ndarray, eos_token_ids: np.ndarray) -> None:
        num = len(states)
        self._finished = finished  # RequestColumns.finished (shared, updated in place)
        self._states = states
        self.penalised = np.zeros(num, dtype=bool)
        self.presence = np.zeros(num, dtype=np.float32)
        self.frequency = np.zeros(num, dtype=np.float32)
        self.repetition = np.ones(num, dtype=np.float32)
        self.slot = np.full(num, -1, dtype=np.int64)
        self.min_tokens: np.ndarray | None = None  # None: no request has min_tokens
        self._free: list[int] = []
        self.num_slots = 0
        min_tokens = np.zeros(num, dtype=np.int64)
        banned: list[np.ndarray] = []
        for i, state in enumerate(states):
            params = state.request.params
            self.penalised[i] = params.has_penalties
            self.presence[i], self.frequency[i] = params.presence_penalty, params.frequency_penalty
            self.repetition[i] = params.repetition_penalty
            min_tokens[i] = params.min_tokens
            # vLLM's all_stop_token_ids: EOS (unless ignored) and stop_token_ids
            banned.append(np.union1d(np.array(params.stop_token_ids, dtype=np.int64),
                                     eos_token_ids if not params.ignore_eos else np.zeros(0, dtype=np.int64))
                          if params.min_tokens else np.zeros(0, dtype=np.int64))
        self._any_penalised = bool(self.penalised.any())
        if min_tokens.any():
            self.min_tokens = min_tokens
            self._ban_len = np.array([ids.shape[0] for ids in banned], dtype=np.int64)
            self._ban_start = np.concatenate([[0], np.cumsum(self._ban_len)[:-1]]).astype(np.int64)
            self._ban_ids = np.concatenate(banned).astype(np.int64)

    def rows(self, index: np.ndarray, output_index: np.ndarray) -> PenaltyRows | None:
        """The penalties and bans of requests `index` sampling their output_index-th tokens; None
        when none has any (no device work then)."""
        ban_rows = ban_ids = _EMPTY
        if self.min_tokens is not None:
            banned = np.flatnonzero((output_index < self.min_tokens[index]) & ~self._finished[index])
            if banned.size:
                lengths = self._ban_len[index[banned]]
                ban_rows = np.repeat(banned, lengths)
                starts = np.repeat(self._ban_start[index[banned]] - np.cumsum(lengths) + lengths, lengths)
                ban_ids = self._ban_ids[starts + np.arange(ban_rows.shape[0])]
        rows = np.flatnonzero(self.penalised[index] & ~self._finished[index]) if self._any_penalised else _EMPTY
        if not rows.size and not ban_rows.size:
            return None
        requests = index[rows]
        new_slots, prompt_slots, prompt_ids = self._take_slots(requests)
        return PenaltyRows(rows, self.slot[requests], self.presence[requests], self.frequency[requests],
                           self.repetition[requests], self.num_slots, new_slots, prompt_slots, prompt_ids,
                           ban_rows, ban_ids)

    def _take_slots(self, requests: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Slots for the requests that hold none yet: (those slots, and the (slot, prompt id) pairs
        of those that have a repetition penalty, which counts the prompt)."""
        starting = requests[self.slot[requests] < 0]
        if not starting.size:
            return _EMPTY, _EMPTY, _EMPTY
        if len(self._free) < starting.size:  # take back the slots of finished requests
            done = np.flatnonzero((self.slot >= 0) & self._finished)
            self._free.extend(self.slot[done].tolist())
            self.slot[done] = -1
        num_new = max(0, int(starting.size) - len(self._free))
        self._free.extend(range(self.num_slots, self.num_slots + num_new))
        self.num_slots += num_new
        slots = np.array(self._free[-starting.size:], dtype=np.int64)
        del self._free[-starting.size:]
        self.slot[starting] = slots
        prompts = [(slot, self._states[i].request.prompt_token_ids)
                   for slot, i in zip(slots.tolist(), starting.tolist()) if self.repetition[i] != 1.0]
        if not prompts:
            return slots, _EMPTY, _EMPTY
        prompt_slots = np.concatenate([np.full(len(ids), slot, dtype=np.int64) for slot, ids in prompts])
        prompt_ids = np.concatenate([np.asarray(ids, dtype=np.int64) for _, ids in prompts])
        return slots, prompt_slots, prompt_ids


_EMPTY = np.zeros(0, dtype=np.int64)
