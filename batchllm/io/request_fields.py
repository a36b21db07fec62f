"""What batchllm does with each request field (torch-free).

Every body field is in exactly one table:
  HONOURED_FIELDS   read and acted on;
  NO_OP_VALUES      not implemented: refused (unsupported_feature) unless set to a value that
                    asks for nothing (null always counts as unset);
  HARMLESS_FIELDS   accepted without effect, for the reason given: the answer is the same with
                    or without them. A value other than the listed defaults is a counted warning.
Any other body field is refused (unknown_field), so nothing a request asks for is silently
dropped. tests/test_io_request_fields.py checks that every request field of the OpenAI SDK and
of vLLM (SamplingParams and its OpenAI request types) is in one of the tables.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ANY = None  # HARMLESS_FIELDS default: every value is a default (never warned about)

HONOURED_FIELDS = frozenset({
    "messages", "prompt", "prompt_token_ids", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "n",
    "include_stop_str_in_output", "logit_bias", "skip_special_tokens", "echo", "prompt_logprobs", "best_of",
    "return_token_ids", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_tokens",
    # structured outputs (batchllm/io/structured_fields.py)
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
})

# name -> the values that ask for nothing (besides null). A per-endpoint dict where they differ.
NO_OP_VALUES: dict[str, tuple | dict[str, tuple]] = {
    # sampling that is not implemented
    "use_beam_search": (False,), "length_penalty": (1,), "watermarking": (False,), "allowed_token_ids": (),
    "bad_words": ([],), "thinking_token_budget": (), "repetition_detection": (), "extra_args": ({},),
    "vllm_xargs": ({},), "logits_processors": ([],),
    # other outputs than the completion text and its logprobs
    "suffix": ("",), "prompt_logprob_token_ids": ([],),
    "prompt_logprob_start": (), "logprob_token_ids": ([],), "return_tokens_as_token_ids": (False,),
    "return_token_offsets": (False,), "return_prompt_text": (False,),
    "return_weight_versions": (False,), "return_mm_kwargs": (False,), "routed_experts_prompt_start": (0,),
    "trace_decode_token_ids": ([],), "audio": (), "modalities": (["text"],), "detokenize": (True,),
    "spaces_between_special_tokens": (True,), "include_reasoning": (True,),
    "reasoning_effort": (), "verbosity": (), "moderation": (),
    # tools: batchllm generates plain text (or structured outputs, HONOURED_FIELDS)
    "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "guided_decoding_backend": ("auto", "xgrammar"), "guided_whitespace_pattern": (), "web_search_options": (),
    # other ways to build or cut the prompt
    "add_generation_prompt": (True,), "continue_final_message": (False,),
    "add_special_tokens": {"chat": (False,), "completion": (True,)}, "documents": (), "chat_template": (),
    "chat_template_kwargs": ({},), "media_io_kwargs": ({},), "mm_processor_kwargs": ({},), "mm_payload": (),
    "prompt_embeds": (), "truncate_prompt_tokens": (),
    # disaggregated serving
    "kv_transfer_params": (), "ec_transfer_params": (),
}

# name -> (defaults: the values not warned about besides null, or ANY; why the answer does not depend on it)
HARMLESS_FIELDS: dict[str, tuple[tuple | None, str]] = {
    "model": (ANY, "the response names the model that ran"),
    "user": (("",), "an end-user id for a hosted API"),
    "safety_identifier": (("",), "an end-user id for a hosted API"),
    "metadata": (({},), "labels for a hosted API's dashboard"),
    "store": ((False,), "output storage on a hosted API"),
    "service_tier": (("auto", "default"), "a hosted API's processing tier"),
    "stream": ((False,), "batch results are written whole"),
    "stream_options": (ANY, "applies to streaming only"),
    "stream_interval": (ANY, "applies to streaming only"),
    "output_kind": (ANY, "vLLM's streaming granularity: results are written whole"),
    "prompt_cache_key": (ANY, "a prefix-caching hint: batchllm shares every common prefix of the job"),
    "prompt_cache_retention": (ANY, "a prefix-caching hint: batchllm shares every common prefix of the job"),
    "prompt_cache_options": (ANY, "a prefix-caching hint: batchllm shares every common prefix of the job"),
    "cache_salt": (ANY, "separates prefix caches of a server's users; a job shares only its own prefixes"),
    "skip_reading_prefix_cache": (ANY, "a prefix-caching hint; reused prefixes give the same answer"),
    "prediction": (ANY, "a latency hint: the answer does not depend on it"),
    "parallel_tool_calls": (ANY, "applies to tools only, which are refused"),
    "truncation_side": (ANY, "applies with truncate_prompt_tokens only, which is refused"),
    "priority": ((0,), "scheduling order: every line is answered"),
    "request_id": (ANY, "custom_id names the request"),
    "session_id": (ANY, "a server's session routing"),
    "skip_clone": (ANY, "vLLM's in-memory copying of its parameters"),
    "flat_logprobs": (ANY, "vLLM's in-memory layout of logprobs"),
    "output_text_buffer_length": (ANY, "vLLM's internal stop-string buffer"),
}


@dataclass(frozen=True)
class FieldRefusal:
    code: str  # "unsupported_feature" | "unknown_field"
    message: str


@dataclass(frozen=True)
class FieldWarning:
    """A field accepted without effect on one line; the job counts them per (field, reason)."""

    field: str
    reason: str

    def __str__(self) -> str:
        return f"{self.field!r} ignored: {self.reason}"


def check_fields(body: dict, endpoint: str) -> tuple[FieldRefusal | None, tuple[FieldWarning, ...]]:
    """The first refused field of a request body (in the body's order), and the warnings of the
    harmless fields it sets to other than their defaults."""
    warnings = []
    for name, value in body.items():
        if name in HONOURED_FIELDS:
            continue
        if name in NO_OP_VALUES:
            no_ops = NO_OP_VALUES[name]
            no_ops = no_ops[endpoint] if isinstance(no_ops, dict) else no_ops
            if value is not None and not any(same_json(value, no_op) for no_op in no_ops):
                accepted = ", ".join(["null", *(_json_repr(v) for v in no_ops)])
                return FieldRefusal("unsupported_feature", f"{name}={_json_repr(value)} is not supported: remove "
                                    f"{name!r} from the request (accepted: {accepted})"), ()
            continue
        if name in HARMLESS_FIELDS:
            defaults, reason = HARMLESS_FIELDS[name]
            if value is not None and defaults is not ANY and not any(same_json(value, d) for d in defaults):
                warnings.append(FieldWarning(name, reason))
            continue
        return FieldRefusal("unknown_field", f"unknown field {_json_repr(name)}: not an OpenAI or vLLM request "
                            "field that batchllm knows; remove it or fix its spelling"), ()
    return None, tuple(warnings)


def same_json(value: object, expected: object) -> bool:
    """JSON equality where true is not 1 and false is not 0 (numbers compare by value)."""
    if isinstance(value, bool) or isinstance(expected, bool):
        return type(value) is type(expected) and value == expected
    if isinstance(value, (int, float)) and isinstance(expected, (int, float)):
        return value == expected
    if type(value) is not type(expected):
        return False
    if isinstance(value, dict):
        return value.keys() == expected.keys() and all(same_json(value[k], expected[k]) for k in value)
    if isinstance(value, list):
        return len(value) == len(expected) and all(same_json(a, b) for a, b in zip(value, expected))
    return value == expected


def _json_repr(value: object, limit: int = 60) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):  # not JSON (a Python caller's object)
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."
