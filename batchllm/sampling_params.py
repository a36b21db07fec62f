"""Per-request sampling parameters (torch-free)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field


class SamplingParamsError(ValueError):
    """An invalid sampling value; the message names the field and the accepted range."""


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the completion's text, in the style of vLLM's `StructuredOutputsParams`:
    exactly one of json (a JSON schema, as a dict or its JSON text), regex, choice (the answer is
    one of these strings), grammar (EBNF/GBNF, or Lark when it has no "::=") and json_object (any
    JSON object). Checked against the grammar library when the request is prepared."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # True: JSON without whitespace between its elements
    # the request field it came from, named in error messages ("response_format", "guided_json", ...)
    source: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        given = [kind for kind in STRUCTURED_KINDS if getattr(self, kind) is not None]
        if len(given) != 1:
            raise SamplingParamsError(f"{self.source} must give exactly one of {', '.join(STRUCTURED_KINDS)}, "
                                      f"got {', '.join(given) or 'none'}")
        if isinstance(self.json, dict):  # held as text (key order kept: it is the output's order)
            object.__setattr__(self, "json", json.dumps(self.json, ensure_ascii=False))
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        for kind in ("json", "regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise SamplingParamsError(f"{self.source}: {kind} must be a non-empty string, got {short_repr(value)}")
        if self.choice is not None and (not isinstance(self.choice, tuple) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise SamplingParamsError(f"{self.source}: choice must be a non-empty list of non-empty strings, "
                                      f"got {short_repr(self.choice)}")
        if self.json_object is not None and self.json_object is not True:
            raise SamplingParamsError(f"{self.source}: json_object must be true, got {short_repr(self.json_object)}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise SamplingParamsError(f"{self.source}: disable_any_whitespace must be true or false, "
                                      f"got {short_repr(self.disable_any_whitespace)}")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of STRUCTURED_KINDS."""
        return next(kind for kind in STRUCTURED_KINDS if getattr(self, kind) is not None)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's completion, in the style of vLLM's `SamplingParams`.

    temperature below GREEDY_TEMPERATURE (vLLM's 1e-5) means greedy. `seed` fixes the sampling
    noise: a hash of (seed, output index, vocab id), whatever the request's batch neighbours
    (README, "Input and output", says what that makes reproducible).
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
    skip_special_tokens: bool = True  # False: special tokens (e.g. "<|im_end|>") stay in the text
    # number of top logprobs per prompt position (vLLM's prompt_logprobs; 0: only the prompt's token)
    prompt_logprobs: int | None = None
    logprobs: int | None = None  # number of top logprobs to return per token (0: only the sampled one)
    # Completions per prompt: the prompt is computed once (its samples share it as one prefix
    # group); sample k samples with sample_seed(seed, k), so sample 0 is the n=1 answer.
    n: int = 1
    # OpenAI `logit_bias`: {token id: bias in [-100, 100]} added to the logits before sampling
    # (greedy included). Given as a mapping (keys int or decimal strings, as in JSON); held as
    # sorted (token_id, bias) pairs so the object stays hashable.
    logit_bias: tuple[tuple[int, float], ...] | None = None
    # Constrain the text to a JSON schema, regex, choice or grammar (README, "Structured outputs").
    structured_outputs: StructuredOutputsParams | None = None
    # OpenAI penalties over the tokens generated so far: logit -= frequency_penalty * count +
    # presence_penalty * (count > 0); each in [-2, 2].
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # HF / vLLM repetition penalty over the prompt and the generated tokens: a seen token's logit
    # is divided by it when positive, multiplied when not; > 0, 1 is off.
    repetition_penalty: float = 1.0
    # EOS and stop_token_ids cannot be sampled, and no stop ends the request, before min_tokens tokens.
    min_tokens: int = 0

    def __post_init__(self) -> None:
        # Normalise list inputs so the object stays hashable and immutable.
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else _as_tuple(self.stop, "stop"))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids"))
        object.__setattr__(self, "logit_bias", _normalise_logit_bias(self.logit_bias))
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_NUM_SAMPLES:
            raise SamplingParamsError(f"n must be an integer in [1, {MAX_NUM_SAMPLES}], got {short_repr(self.n)}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1
        ):
            raise SamplingParamsError(f"max_tokens must be an integer >= 1, got {short_repr(self.max_tokens)}")
        if not _is_number(self.temperature) or self.temperature < 0 or not _is_finite(self.temperature):
            raise SamplingParamsError(f"temperature must be a finite number >= 0, got {short_repr(self.temperature)}")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise SamplingParamsError(f"top_p must be in (0, 1], got {short_repr(self.top_p)}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise SamplingParamsError(f"top_k must be an integer >= 1, or -1/0 to disable, got {short_repr(self.top_k)}")
        if not _is_number(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise SamplingParamsError(f"min_p must be in [0, 1], got {short_repr(self.min_p)}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise SamplingParamsError(f"seed must be an integer, got {short_repr(self.seed)}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise SamplingParamsError("stop must be a non-empty string or a list of non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids must be a list of non-negative integers")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool) or not (0 <= self.logprobs <= 20)
        ):
            raise SamplingParamsError(f"logprobs must be an integer in [0, 20], got {short_repr(self.logprobs)}")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or isinstance(self.prompt_logprobs, bool)
            or not (0 <= self.prompt_logprobs <= 20)
        ):
            raise SamplingParamsError(f"prompt_logprobs must be an integer in [0, 20], got {short_repr(self.prompt_logprobs)}")
        if not isinstance(self.skip_special_tokens, bool):
            raise SamplingParamsError(f"skip_special_tokens must be true or false, got {short_repr(self.skip_special_tokens)}")
        if not isinstance(self.ignore_eos, bool):
            raise SamplingParamsError(f"ignore_eos must be true or false, got {short_repr(self.ignore_eos)}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise SamplingParamsError(
                f"include_stop_str_in_output must be true or false, got {short_repr(self.include_stop_str_in_output)}")
        self._check_penalties()
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise SamplingParamsError("structured_outputs must be a StructuredOutputsParams, got "
                                          f"{short_repr(self.structured_outputs)}")
            if self.ignore_eos:
                raise SamplingParamsError(f"ignore_eos cannot be combined with {self.structured_outputs.source}: "
                                          "a structured answer ends with the end-of-sequence token")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:  # NaN fails too
                raise SamplingParamsError(f"{name} must be a number in [-2, 2], got {short_repr(value)}")
        repetition = self.repetition_penalty
        if not _is_number(repetition) or not (repetition > 0 and _is_finite(repetition)):
            raise SamplingParamsError("repetition_penalty must be a finite number > 0 (1 is off), "
                                      f"got {short_repr(self.repetition_penalty)}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise SamplingParamsError(f"min_tokens must be an integer >= 0, got {short_repr(self.min_tokens)}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """Whether a presence, frequency or repetition penalty is on (min_tokens is not one)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


MAX_LOGIT_BIAS = 100.0
MAX_NUM_SAMPLES = 128  # the largest n (OpenAI's limit): more is one line asking for a whole batch's work
_MASK64 = (1 << 64) - 1


def sample_seed(seed: int, sample_index: int) -> int:
    """The seed of sample sample_index of a request seeded with seed: seed itself for sample 0
    (so sample 0 is the answer of the same request with n=1), a splitmix64 hash of (seed,
    index) in [0, 2**63) for the others, so that samples differ in every bit the sampler reads."""
    if sample_index == 0:
        return seed
    z = (seed + sample_index * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1
MAX_TOKEN_ID = (1 << 31) - 1  # token ids are held as int32
# Below this a temperature samples as greedy (vLLM's _SAMPLING_EPS): dividing by it would leave
# nothing but the top token anyway (the sampler subtracts the row's top logit first, so no
# temperature overflows).
GREEDY_TEMPERATURE = 1e-5


def _as_tuple(value: object, name: str) -> tuple:
    if value is None:
        return ()
    if not isinstance(value, (tuple, list)):
        raise SamplingParamsError(f"{name} must be a list, got {short_repr(value, 80)}")
    return tuple(value)


def _normalise_logit_bias(value: object) -> tuple[tuple[int, float], ...] | None:
    """A {token id: bias} mapping (or (id, bias) pairs) -> sorted pairs; None or empty -> None."""
    if value is None:
        return None
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (tuple, list)) and all(isinstance(p, (tuple, list)) and len(p) == 2 for p in value):
        items = [tuple(p) for p in value]
    else:
        raise SamplingParamsError(f"logit_bias must map token ids to numbers, got {short_repr(value, 80)}")
    pairs: dict[int, float] = {}
    for key, bias in items:
        token_id = _token_id_key(key)
        if not _is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # NaN fails too
            raise SamplingParamsError(f"logit_bias[{short_repr(key)}] must be a number in [-100, 100], got {short_repr(bias)}")
        if token_id in pairs:
            raise SamplingParamsError(f"logit_bias names token id {token_id} twice")
        pairs[token_id] = float(bias)
    return tuple(sorted(pairs.items())) or None


def _token_id_key(key: object) -> int:
    # a decimal string no longer than MAX_TOKEN_ID's digits (int() of a long one is slow or refused)
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= len(str(MAX_TOKEN_ID)):
        key = int(key)
    if isinstance(key, int) and not isinstance(key, bool) and 0 <= key <= MAX_TOKEN_ID:
        return key
    raise SamplingParamsError(f"logit_bias keys must be token ids (integers in [0, {MAX_TOKEN_ID}]), "
                              f"got {short_repr(key)}")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_finite(value: int | float) -> bool:
    """True if value is a finite float once converted (an integer past 1.8e308 is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def short_repr(value: object, limit: int = 40) -> str:
    """repr of a value for a message, cut to limit characters (an integer of thousands of
    digits is not written out)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
