"""Grammars over a vocabulary (batchllm/structured): what is refused and with which message, the
compile cache, a request's GrammarState, and the step bitmask the filler sends."""

from __future__ import annotations

import pytest
import torch
import xgrammar

from batchllm.ops.transfer import PinnedStaging
from batchllm.sampling_params import StructuredOutputsParams
from batchllm.structured.backend import GrammarBackend
from batchllm.structured.errors import StructuredOutputError
from batchllm.structured.grammars import build_grammar
from batchllm.structured.synthetic_vocabulary import synthetic_vocabulary
from batchllm.structured.vocabulary import GrammarVocabulary

EOS = 2


@pytest.fixture(scope="module")
def backend():
    backend = GrammarBackend(synthetic_vocabulary(600, [EOS]))
    yield backend
    backend.shutdown()


def _ids(vocabulary: GrammarVocabulary, text: bytes) -> list[int]:
    """text as single-byte tokens of the synthetic vocabulary."""
    return [vocabulary.token_bytes.index(bytes([b])) for b in text]


@pytest.mark.parametrize("spec, message", [
    (StructuredOutputsParams(json={"type": "objec"}, source="guided_json"),
     'guided_json: invalid JSON schema: Unsupported type "objec"'),
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}},
                             source="response_format"),
     "response_format: invalid JSON schema: "),
    (StructuredOutputsParams(regex="a(b", source="guided_regex"),
     "guided_regex: invalid regex: Regex parsing error at position 4: The parenthesis is not closed."),
    (StructuredOutputsParams(grammar='root ::= "a" | ', source="guided_grammar"),
     "guided_grammar: invalid EBNF grammar: EBNF parser error at line 1, column 16: Expect element, but got"),
    (StructuredOutputsParams(grammar="start: (", source="structured_outputs"),
     "structured_outputs: invalid Lark grammar: "),
])
def test_a_bad_schema_regex_or_grammar_is_refused_naming_the_field_and_the_reason(spec, message):
    with pytest.raises(StructuredOutputError) as raised:
        build_grammar(spec)
    assert str(raised.value).startswith(message)
    assert "/project/" not in str(raised.value) and "\n" not in str(raised.value)


def test_lark_and_ebnf_grammars_and_choices_build():
    assert "root ::=" in str(build_grammar(StructuredOutputsParams(grammar='start: "yes" | "no"')))
    assert "root ::=" in str(build_grammar(StructuredOutputsParams(grammar='root ::= "yes" | "no"')))
    choice = str(build_grammar(StructuredOutputsParams(choice=('say "hi"', "a\\b"))))
    assert '"say \\"hi\\""' in choice and '"a\\\\b"' in choice


def test_the_same_spec_compiles_once(backend):
    first = backend.submit(StructuredOutputsParams(regex="[0-9]{2}", source="guided_regex"))
    again = backend.submit(StructuredOutputsParams(regex="[0-9]{2}", source="structured_outputs"))
    other = backend.submit(StructuredOutputsParams(regex="[0-9]{3}"))
    assert first is again and other is not first
    assert isinstance(first.result(), xgrammar.CompiledGrammar)


def test_a_grammar_state_follows_its_choice_to_the_end_of_sequence(backend):
    vocabulary = backend.vocabulary
    state = backend.grammar_state(StructuredOutputsParams(choice=("yes", "no")))
    rows, bitmask = backend.filler.fill([state], [4], vocabulary.vocab_size, PinnedStaging(torch.device("cpu")))
    assert rows.tolist() == [4]
    allowed = {t for t in range(vocabulary.vocab_size) if bitmask[0, t // 32] >> (t % 32) & 1}
    # the tokens that start "yes" or "no": single bytes and longer pieces of the vocabulary
    expected = {t for t, piece in enumerate(vocabulary.token_bytes)
                if piece and (b"yes".startswith(piece) or b"no".startswith(piece))}
    assert allowed == expected and {_ids(vocabulary, b"y")[0], _ids(vocabulary, b"n")[0]} <= allowed
    y, e, s = _ids(vocabulary, b"yes")
    assert state.advance(y, None) is None and state.advance(e, None) is None
    assert state.advance(s, "length") == "length"  # complete, but it ends with its end-of-sequence token
    assert state.advance(EOS, None) == "stop" and state.is_terminated()
    with pytest.raises(StructuredOutputError, match=f"token {y} does not continue the structured_outputs grammar"):
        state.advance(y, None)


def test_the_filled_bitmask_is_each_matchers_own(backend):
    vocabulary = backend.vocabulary
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    states = [backend.grammar_state(StructuredOutputsParams(json=schema)),
              backend.grammar_state(StructuredOutputsParams(regex="[a-c]+x"))]
    for token in _ids(vocabulary, b'{"n": 1'):
        states[0].advance(token, None)
    states[1].advance(_ids(vocabulary, b"a")[0], None)
    rows, bitmask = backend.filler.fill(states, [0, 7], vocabulary.vocab_size, PinnedStaging(torch.device("cpu")))
    assert rows.tolist() == [0, 7] and bitmask.shape == (2, -(-vocabulary.vocab_size // 32))
    for index, state in enumerate(states):
        own = xgrammar.allocate_token_bitmask(1, vocabulary.vocab_size)
        state.matcher.fill_next_token_bitmask(own)
        assert torch.equal(bitmask[index], own[0])


def test_a_failed_compile_is_the_requests_error(backend, monkeypatch):
    def refuse(grammar):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(backend._compiler, "compile_grammar", refuse)
    state = backend.grammar_state(StructuredOutputsParams(regex="z{5}", source="guided_regex"))
    with pytest.raises(StructuredOutputError, match="guided_regex: the grammar does not compile: out of memory"):
        state.matcher  # noqa: B018


def test_the_vocabulary_blanks_special_tokens_and_keeps_the_models_size():
    vocabulary = GrammarVocabulary.from_token_bytes([b"<s>", b"a", b"</s>", b"b"], special_ids=[0, 2], vocab_size=6,
                                                    stop_token_ids=[2, 2])
    assert list(vocabulary.token_bytes) == [b"", b"a", b"", b"b"] and vocabulary.stop_token_ids == (2,)
    info = vocabulary.tokenizer_info()
    assert info.vocab_size == 6 and info.stop_token_ids == [2]


def test_the_synthetic_vocabulary_is_deterministic_and_has_every_byte():
    first = synthetic_vocabulary(1000, [0, 999], seed=3)
    assert first == synthetic_vocabulary(1000, [0, 999], seed=3)
    assert first.token_bytes[0] == first.token_bytes[999] == b"" and first.stop_token_ids == (0, 999)
    pieces = [piece for piece in first.token_bytes if piece]
    assert len(pieces) == len(set(pieces)) == 998
    assert {bytes([b]) for b in range(256)} <= set(pieces)
    assert b'":' in pieces and b"\n  " in pieces  # JSON punctuation pieces, as a BPE vocabulary has
