"""Per-request sampling parameters (torch-free)."""

from __future__ import annotations

import math
from dataclasses import dataclass


class SamplingParamsError(ValueError):
    """An invalid sampling value; the message names the field and the accepted range."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's completion, in the style of vLLM's `SamplingParams`.

    temperature 0 means greedy. `seed` makes a sampled request reproducible independently of
    how it is batched (the noise is a hash of (seed, output index, vocab id)).
    """

    max_tokens: int | None = 16  # None: generate up to the model's context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): no top-k cut
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token (0: only the sampled one)
    n: int = 1

    def __post_init__(self) -> None:
        # Normalise list inputs so the object stays hashable and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self.validate()

    def validate(self) -> None:
        if self.n != 1:
            raise SamplingParamsError(f"n={self.n} is not supported yet: only n=1 (one completion per request)")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1
        ):
            raise SamplingParamsError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0 or not math.isfinite(self.temperature):
            raise SamplingParamsError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise SamplingParamsError(f"top_k must be an integer >= 1, or -1/0 to disable, got {self.top_k!r}")
        if not _is_number(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise SamplingParamsError(f"seed must be an integer, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise SamplingParamsError("stop must be a non-empty string or a list of non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids must be a list of non-negative integers")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not (0 <= self.logprobs <= 20)):
            raise SamplingParamsError(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
