"""No request field slips through: every field of the OpenAI SDK's request types and of vLLM's
SamplingParams and OpenAI request types is honoured, refused unless at its no-op value, or on
the documented list of harmless fields (batchllm/io/request_fields.py).

The OpenAI field names come from the pinned `openai` dev dependency; vLLM's from its source
distribution, which `make install` / `make test` unpack into the venv (Makefile, VLLM_VERSION):
vLLM itself cannot be installed without CUDA. The files are parsed with `ast`, never imported."""

from __future__ import annotations

import ast
import json
import os
import sys
import typing
from pathlib import Path

import pytest
from io_helpers import parse_lines

from batchllm.io.batch_input import BatchError, BatchRequest
from batchllm.io.request_fields import HARMLESS_FIELDS, HONOURED_FIELDS, NO_OP_VALUES

KNOWN = HONOURED_FIELDS | set(NO_OP_VALUES) | set(HARMLESS_FIELDS)
VLLM_CLASSES = [("vllm/sampling_params.py", "SamplingParams"),
                ("vllm/entrypoints/openai/chat_completion/protocol.py", "ChatCompletionRequest"),
                ("vllm/entrypoints/openai/completion/protocol.py", "CompletionRequest")]


def _missing(what: str):
    pytest.fail(f"{what} is missing: run `make install`")


def _openai_fields() -> dict[str, set[str]]:
    try:
        from openai.types import completion_create_params
        from openai.types.chat import completion_create_params as chat_create_params
    except ImportError:
        _missing("the openai package (a dev dependency)")
    fields = {}
    for name, module in (("chat", chat_create_params), ("completion", completion_create_params)):
        fields[name] = {field for cls in (module.CompletionCreateParamsNonStreaming,
                                          module.CompletionCreateParamsStreaming)
                        for field in typing.get_type_hints(cls)}
    return fields


def _vllm_source() -> Path:
    upstream = Path(os.environ.get("BATCHLLM_UPSTREAM_DIR", Path(sys.prefix) / "upstream"))
    sources = sorted(upstream.glob("vllm-*"))
    if len(sources) != 1:
        _missing(f"vLLM's source ({upstream}/vllm-<version>)")
    return sources[0]


def _class_fields(path: Path, class_name: str) -> set[str]:
    """The public fields a class declares (annotated names, and their pydantic aliases)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name]
    fields = set()
    for statement in node.body:
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            continue
        if statement.target.id.startswith("_") or "ClassVar" in ast.unparse(statement.annotation):
            continue
        fields.add(statement.target.id)
        if isinstance(statement.value, ast.Call):
            fields |= {k.value.value for k in statement.value.keywords
                       if k.arg == "alias" and isinstance(k.value, ast.Constant)}
    return fields


def test_every_openai_request_field_is_handled():
    fields = _openai_fields()
    assert len(fields["chat"]) >= 30 and len(fields["completion"]) >= 15  # the walk found the types
    assert {"messages", "presence_penalty", "stream"} <= fields["chat"]
    assert {"prompt", "echo", "suffix", "best_of"} <= fields["completion"]
    assert sorted((fields["chat"] | fields["completion"]) - KNOWN) == []


def test_every_vllm_request_field_is_handled():
    source = _vllm_source()
    fields = {cls: _class_fields(source / path, cls) for path, cls in VLLM_CLASSES}
    assert len(fields["SamplingParams"]) >= 30 and {"repetition_penalty", "min_tokens"} <= fields["SamplingParams"]
    assert len(fields["ChatCompletionRequest"]) >= 40 and len(fields["CompletionRequest"]) >= 30
    assert {cls: sorted(names - KNOWN) for cls, names in fields.items()} == {cls: [] for cls in fields}


def test_the_tables_do_not_overlap():
    assert not HONOURED_FIELDS & set(NO_OP_VALUES) and not HONOURED_FIELDS & set(HARMLESS_FIELDS)
    assert not set(NO_OP_VALUES) & set(HARMLESS_FIELDS)


def _parse_body(endpoint: str, **fields) -> BatchRequest | BatchError:
    url, prompt = {"chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                   "completion": ("/v1/completions", {"prompt": "hi"})}[endpoint]
    line = {"custom_id": "a", "method": "POST", "url": url, "body": {**prompt, **fields}}
    (item,) = parse_lines([json.dumps(line)])
    return item


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_unsupported_fields_are_refused_unless_at_their_no_op_value(endpoint):
    for name, no_ops in NO_OP_VALUES.items():
        no_ops = no_ops[endpoint] if isinstance(no_ops, dict) else no_ops
        for value in (None, *no_ops):
            assert isinstance(_parse_body(endpoint, **{name: value}), BatchRequest), (name, value)
        refused = _parse_body(endpoint, **{name: {"asks": "for something"}})
        assert isinstance(refused, BatchError) and refused.code == "unsupported_feature", name
        assert refused.message.startswith(f"{name}=") and f"remove {name!r}" in refused.message


@pytest.mark.parametrize("name, value, accepted, no_ops", [
    ("suffix", "!", 'null, ""', [""]),
    ("prompt_logprob_token_ids", [3], "null, []", [[]]), ("guided_whitespace_pattern", " ", "null", []),
])
def test_fields_that_were_accepted_and_ignored_are_refused(name, value, accepted, no_ops):
    """Regression: these were answered with status 200 as if they had been applied."""
    refused = _parse_body("completion", **{name: value})
    assert (refused.code, refused.custom_id) == ("unsupported_feature", "a")
    assert refused.message == (f"{name}={json.dumps(value)} is not supported: remove {name!r} from the request "
                               f"(accepted: {accepted})")
    for no_op in [None, *no_ops]:
        accepted = _parse_body("completion", **{name: no_op})
        assert isinstance(accepted, BatchRequest) and accepted.warnings == ()


def test_a_bool_is_not_a_number_for_no_op_values():
    assert _parse_body("completion", length_penalty=True).code == "unsupported_feature"


def test_echo_and_prompt_logprobs_are_read():
    plain = _parse_body("completion", echo=True)
    assert plain.echo and plain.sampling.prompt_logprobs is None  # echo without logprobs: the text only
    scored = _parse_body("completion", echo=True, logprobs=2)
    assert scored.echo and scored.sampling.prompt_logprobs == 2  # vLLM: echo + logprobs scores the prompt too
    assert _parse_body("completion", echo=True, logprobs=2, prompt_logprobs=4).sampling.prompt_logprobs == 4
    assert _parse_body("chat", prompt_logprobs=0).sampling.prompt_logprobs == 0
    assert _parse_body("completion", echo=False).echo is False
    assert _parse_body("completion", echo=0).code == "invalid_sampling"  # a bool, not a number
    refused = _parse_body("chat", echo=True)
    assert refused.code == "unsupported_feature" and "/v1/completions only" in refused.message
    assert _parse_body("completion", prompt_logprobs=21).code == "invalid_sampling"
    assert _parse_body("completion", skip_special_tokens=False).sampling.skip_special_tokens is False


def test_add_special_tokens_no_op_follows_the_endpoint():
    assert isinstance(_parse_body("chat", add_special_tokens=False), BatchRequest)
    assert isinstance(_parse_body("completion", add_special_tokens=True), BatchRequest)
    assert _parse_body("chat", add_special_tokens=True).code == "unsupported_feature"
    assert _parse_body("completion", add_special_tokens=False).code == "unsupported_feature"


def test_harmless_fields_are_accepted_with_any_value():
    for name in HARMLESS_FIELDS:
        assert isinstance(_parse_body("chat", **{name: {"any": "value"}}), BatchRequest), name


def test_penalties_and_min_tokens_reach_the_sampling_params():
    request = _parse_body("completion", presence_penalty=0.5, frequency_penalty=-2, repetition_penalty=1.25,
                          min_tokens=3, max_tokens=8)
    assert isinstance(request, BatchRequest) and request.warnings == ()
    sampling = request.sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty,
            sampling.min_tokens) == (0.5, -2, 1.25, 3)
    assert _parse_body("chat", presence_penalty=None, min_tokens=None).sampling.min_tokens == 0


@pytest.mark.parametrize("fields, message", [
    ({"presence_penalty": 2.5}, "presence_penalty must be a number in [-2, 2], got 2.5"),
    ({"frequency_penalty": -3}, "frequency_penalty must be a number in [-2, 2], got -3"),
    ({"frequency_penalty": True}, "frequency_penalty must be a number in [-2, 2], got True"),
    ({"repetition_penalty": 0}, "repetition_penalty must be a finite number > 0 (1 is off), got 0"),
    ({"repetition_penalty": "1.2"}, "repetition_penalty must be a finite number > 0 (1 is off), got '1.2'"),
    ({"min_tokens": -1}, "min_tokens must be an integer >= 0, got -1"),
    ({"min_tokens": 1.5}, "min_tokens must be an integer in [-2147483647, 2147483647], got 1.5"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens (9) must be at most max_tokens (8)"),
])
def test_bad_penalties_and_min_tokens_are_refused_on_their_line(fields, message):
    refused = _parse_body("completion", **fields)
    assert isinstance(refused, BatchError)
    assert (refused.code, refused.custom_id, refused.message) == ("invalid_sampling", "a", message)
