"""Structured outputs through the engine's step loop, on random:tiny with a synthetic vocabulary
(a model without a tokenizer compiles over the vocabulary the engine is given): every answer
follows its grammar and ends with "stop" at the grammar's end, or "length"; asynchronous and
one-step-at-a-time scheduling give the same tokens; requests without a structured output are
untouched by their neighbours' masks; a grammar that fails costs only its request."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from batchllm.engine.llm_engine import PreparedRequest
from batchllm.engine.run_options import RunOptions
from batchllm.sampling_params import SamplingParams, StructuredOutputsParams
from batchllm.structured.backend import GrammarBackend
from batchllm.structured.errors import StructuredOutputError
from batchllm.structured.grammars import build_grammar
from batchllm.structured.synthetic_vocabulary import synthetic_vocabulary

pytest_plugins = ["model_fixtures"]

EOS = 2  # random:tiny's
REGEX = "[0-9]{3}-[a-z]{2}"
CHOICES = ("alpha", "beta", "gamma delta")
SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["cat", "dog"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "pattern": "^[a-z]{1,4}$"}}},
    "required": ["kind", "n", "tags"]}


@pytest.fixture
def engine(tiny_engine):
    """random:tiny with grammars over a synthetic vocabulary of its 512 ids (restored afterwards)."""
    tiny_engine.grammars = GrammarBackend(synthetic_vocabulary(tiny_engine.arch.vocab_size, [EOS]))
    yield tiny_engine
    tiny_engine.grammars.shutdown()


def _spec(index: int) -> StructuredOutputsParams | None:
    return [StructuredOutputsParams(regex=REGEX), StructuredOutputsParams(choice=CHOICES),
            StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), None][index % 4]


def _requests(engine, num_requests: int, max_tokens: int = 60, constrained: bool = True) -> list[PreparedRequest]:
    requests = []
    for i in range(num_requests):
        prompt = [10 + i % 3] * 20 + [100 + i, 200 + i % 7]
        spec = _spec(i) if constrained else None
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0 if i % 2 else 0.9, seed=i,
                                ignore_eos=spec is None, structured_outputs=spec)
        requests.append(PreparedRequest(i, prompt, engine.limits.check(prompt, params)))
    return requests


def _run(engine, requests, async_scheduling: bool = True, **scheduler_changes) -> dict:
    engine.configure_scheduler(**scheduler_changes)
    return {out.request_id: out for out in engine.run(requests, options=RunOptions(async_scheduling=async_scheduling))}


def _text(engine, token_ids: list[int]) -> str:
    return b"".join(engine.grammars.vocabulary.token_bytes[t] for t in token_ids).decode("utf-8")


def _check_follows_its_grammar(engine, request: PreparedRequest, out) -> None:
    spec = request.params.structured_outputs
    assert out.error is None and out.finish_reason == "stop", (request.request_id, out)
    assert out.output_token_ids[-1] == EOS
    text = _text(engine, out.output_token_ids[:-1])
    if spec.regex is not None:
        assert re.fullmatch(REGEX, text), text
    elif spec.choice is not None:
        assert text in CHOICES
    else:
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_every_structured_answer_follows_its_grammar_and_stops_at_its_end(engine, async_scheduling):
    requests = _requests(engine, 16)
    outputs = _run(engine, requests, async_scheduling, max_num_batched_tokens=128)
    for request in requests:
        if request.params.structured_outputs is not None:
            _check_follows_its_grammar(engine, request, outputs[request.request_id])
        else:
            assert outputs[request.request_id].finish_reason == "length"


def test_asynchronous_scheduling_gives_the_same_tokens_and_free_rows_are_untouched(engine):
    requests = _requests(engine, 16)
    asynchronous = _run(engine, requests, True, max_num_batched_tokens=96)
    synchronous = _run(engine, requests, False, max_num_batched_tokens=96)
    assert {i: o.output_token_ids for i, o in asynchronous.items()} == \
        {i: o.output_token_ids for i, o in synchronous.items()}
    free = _run(engine, _requests(engine, 16, constrained=False), True, max_num_batched_tokens=96)
    for request in requests:
        if request.params.structured_outputs is None:
            assert asynchronous[request.request_id].output_token_ids == free[request.request_id].output_token_ids


def test_max_tokens_before_the_grammar_completes_is_length(engine):
    """Also when the text is a whole choice: the grammar ends with its end-of-sequence token."""
    (request,) = [r for r in _requests(engine, 3, max_tokens=2) if r.params.structured_outputs.choice]
    out = _run(engine, [request])[request.request_id]
    assert out.finish_reason == "length" and len(out.output_token_ids) == 2
    text = _text(engine, out.output_token_ids)
    assert EOS not in out.output_token_ids and any(choice.startswith(text) for choice in CHOICES)


def test_a_grammar_that_does_not_compile_fails_only_its_request(engine, monkeypatch):
    compile_grammar = engine.grammars._compiler.compile_grammar
    regex_grammar = str(build_grammar(StructuredOutputsParams(regex=REGEX)))

    def refuse_regex(grammar):
        if str(grammar) == regex_grammar:
            raise RuntimeError("refused in this test")
        return compile_grammar(grammar)

    monkeypatch.setattr(engine.grammars._compiler, "compile_grammar", refuse_regex)
    requests = _requests(engine, 8)
    outputs = _run(engine, requests)
    for request in requests:
        out = outputs[request.request_id]
        if request.params.structured_outputs is not None and request.params.structured_outputs.regex:
            assert (out.finish_reason, out.error) == (
                "error", "structured_outputs: the grammar does not compile: refused in this test")
            assert out.output_token_ids == []
        elif request.params.structured_outputs is not None:
            _check_follows_its_grammar(engine, request, out)


def test_a_model_without_a_vocabulary_refuses_structured_outputs(tiny_engine):
    params = SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(regex="a"))
    with pytest.raises(StructuredOutputError, match="model random:tiny has no tokenizer: structured outputs need "
                                                    "its vocabulary"):
        tiny_engine.check_structured_outputs(params)
    tiny_engine.check_structured_outputs(SamplingParams())  # nothing asked for: nothing to refuse
    (out,) = tiny_engine.run([PreparedRequest(0, [5, 6], params)])
    assert out.finish_reason == "error" and "has no tokenizer" in out.error
