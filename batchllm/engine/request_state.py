"""The engine's per-request host state and the request/result types of `LLMEngine.run`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from batchllm.engine.sampler import sampling_row
from batchllm.engine.stop_checker import StopChecker
from batchllm.sampling_params import SamplingParams
from batchllm.sched.interface import FinishedRequest, SchedRequest
from batchllm.sched.trace import StepRecord

if TYPE_CHECKING:  # xgrammar loads only for structured outputs
    from batchllm.structured.grammar_state import GrammarState

# The sampling row of a request whose row could not be built: greedy, no logprobs (the row's
# token is dropped, the request is finished with an error).
_NEUTRAL_SAMPLING_ROW = (0.0, 1.0, -1, 0.0, 0, 0, None, None)


@dataclass(frozen=True)
class PreparedRequest:
    """A tokenized request whose params passed RequestLimits.check (max_tokens resolved)."""

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    # the same ids as a 1-D integer numpy array, where the caller made one (LLM.generate, the job
    # path): the prefix planner reads it instead of converting the list again
    prompt_array: np.ndarray | None = None


@dataclass
class FinishedOutput:
    request_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "error"
    logprobs: list[dict[int, float]] | None = None
    num_cached_prompt_tokens: int = 0
    error: str | None = None  # set when the request could not run or failed while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (StopChecker)
    # vLLM's prompt_logprobs: None for the first prompt token, then per position {the prompt's token:
    # logprob, top tokens...}; with each position's prompt-token rank (1: the most likely). None: not asked.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_token_ranks: list[int | None] | None = None


@dataclass
class RunStats:
    num_requests: int = 0
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    seconds: float = 0.0
    step_records: list[StepRecord] = field(default_factory=list)


@dataclass
class RequestState:
    """One running request as the engine sees it. output_token_ids, the ids read so far, is the
    one list of the request's generated tokens: its SchedRequest holds the same list (the
    scheduler reads it, only this state appends to it)."""

    request: PreparedRequest
    stop: StopChecker
    seed: int
    logprobs: list[dict[int, float]] | None
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # set once the last real token is known
    error: str | None = None
    grammar: GrammarState | None = None  # a structured output's place in its grammar
    # filled as the prompt's chunks run (params.prompt_logprobs): FinishedOutput's fields
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_token_ranks: list[int | None] | None = None

    def __post_init__(self) -> None:
        if self.request.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            num_prompt_tokens = len(self.request.prompt_token_ids)
            self.prompt_logprobs, self.prompt_token_ranks = [None] * num_prompt_tokens, [None] * num_prompt_tokens

    def sched_request(self) -> SchedRequest:
        """The request as the scheduler sees it, sharing output_token_ids. A request that asks for
        prompt logprobs shares no prefix: every prompt position's logits must be computed for it."""
        request = self.request
        prompt = request.prompt_token_ids  # never written by the scheduler: shared, not copied
        return SchedRequest(request.request_id, prompt if isinstance(prompt, list) else list(prompt),
                            request.params.max_tokens,
                            self.output_token_ids, share_prefix=request.params.prompt_logprobs is None,
                            prompt_array=request.prompt_array)

    def output_index(self, num_positions: int) -> int:
        """The output index of the token sampled after the first num_positions positions (a sampling
        chunk's kv_len): prompt, then generated tokens."""
        return num_positions - len(self.request.prompt_token_ids)

    def sampling_row(self, output_index: int) -> tuple:
        """This request's SamplingBatch.build row; a neutral row if building it fails."""
        try:
            return sampling_row(self.request.params, self.seed, output_index)
        except Exception as error:  # noqa: BLE001 - finish this request only
            self.fail(error)
            return _NEUTRAL_SAMPLING_ROW

    def fail(self, error: Exception) -> None:
        """Finish this request (only) with an internal error; its later rows are dropped."""
        if self.error is None:
            self.error = f"internal_error: {type(error).__name__}: {error}"
        self.finish_reason = "error"

    def add_token(self, token_id: int, logprob_entry: Callable[[], dict[int, float]] | None) -> None:
        """Record a sampled token, its logprobs, and run the stop checks."""
        try:
            self.output_token_ids.append(token_id)
            if self.logprobs is not None:
                self.logprobs.append(logprob_entry())
            finish_reason = self.stop.check(self.output_token_ids)
            if self.grammar is not None:
                finish_reason = self.grammar.advance(token_id, finish_reason)
            self.finish_reason = finish_reason
        except Exception as error:  # noqa: BLE001 - finish this request only
            self.fail(error)

    def finished_output(self, done: FinishedRequest) -> FinishedOutput:
        request = self.request
        output = FinishedOutput(request.request_id, request.prompt_token_ids, list(self.output_token_ids), "",
                                self.finish_reason, self.logprobs, done.num_cached_prompt_tokens, self.error,
                                prompt_logprobs=self.prompt_logprobs, prompt_token_ranks=self.prompt_token_ranks)
        if self.error is None and self.prompt_logprobs is not None and None in self.prompt_logprobs[1:]:
            # every prompt position runs (sched_request: no shared prefix); one left out is a bug, never a gap
            self.fail(RuntimeError("a prompt position's logprobs were not computed"))
            output.finish_reason, output.error = self.finish_reason, self.error
        if self.error is None:
            try:
                output.text = self.stop.final_text(self.output_token_ids, self.finish_reason)
                output.stop_reason = self.stop.stop_reason(self.output_token_ids, self.finish_reason)
            except Exception as error:  # noqa: BLE001 - finish this request only
                self.fail(error)
                output.finish_reason, output.error = self.finish_reason, self.error
        return output
