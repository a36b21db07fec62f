"""Results returned by the Python API, with vLLM's field names and meanings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "error" (an internal error ended this request only)
    logprobs: list[dict[int, float]] | None = None  # per token: {token_id: logprob} (sampled + top-k)
    cumulative_logprob: float | None = None
    # The stop string or stop token id (from stop_token_ids) that ended the completion; None when
    # it ended otherwise (EOS, length), as in vLLM.
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None  # the prompt text; for chat, the conversation as the chat template rendered it
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0  # prompt tokens whose KV was reused instead of computed
    finished: bool = True  # LLM.generate and LLM.chat return finished requests only
    # SamplingParams.prompt_logprobs: None for the first prompt token, then per prompt position
    # {the prompt's token: logprob, then the top prompt_logprobs tokens}, as vLLM; None: not asked for.
    prompt_logprobs: list[dict[int, float] | None] | None = None
