"""Results returned by the Python API (vLLM-style)."""

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


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0  # prompt tokens whose KV was reused instead of computed
