"""Stop conditions: EOS, stop ids, stop strings (checked incrementally), length."""

import dataclasses
import random

import pytest

from batchllm.engine.stop_checker import IncrementalText, StopChecker
from batchllm.sampling_params import SamplingParams

pytest_plugins = ["model_fixtures"]


def _letters(ids):
    return "".join(chr(ord("a") + i) for i in ids)


def _feed(checker: StopChecker, token_ids: list[int]) -> tuple[int, str | None]:
    """Tokens one at a time, as the engine adds them: (number of tokens at the end, reason)."""
    for end in range(1, len(token_ids) + 1):
        reason = checker.check(token_ids[:end])
        if reason is not None:
            return end, reason
    return len(token_ids), None


def test_eos_and_stop_ids_and_ignore_eos():
    state = StopChecker(SamplingParams(max_tokens=10), 10, frozenset({2}), _letters)
    assert state.check([0, 1]) is None
    assert state.check([0, 1, 2]) == "stop"
    assert state.final_text([0, 1, 2], "stop") == "ab"
    ignoring = StopChecker(SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[5]), 10, frozenset({2}),
                           _letters)
    assert ignoring.check([2]) is None
    assert ignoring.check([2, 5]) == "stop"
    assert ignoring.final_text([2, 5], "stop") == "c"


def test_include_stop_str_in_output_keeps_the_stop_token_in_the_text():
    # vLLM's detokenizer leaves a terminating EOS / stop_token_ids token out of the text unless
    # include_stop_str_in_output; the token stays in token_ids, completion_tokens and logprobs.
    params = SamplingParams(max_tokens=10, stop_token_ids=[5], include_stop_str_in_output=True)
    keep = StopChecker(params, 10, frozenset({2}), _letters)
    assert keep.check([0, 5]) == "stop" and keep.final_text([0, 5], "stop") == "af"
    assert keep.final_text([0, 2], "stop") == "ac"  # EOS too (a real tokenizer's EOS decodes to "" when skipped)
    cut = StopChecker(dataclasses.replace(params, include_stop_str_in_output=False), 10, frozenset({2}), _letters)
    assert cut.final_text([0, 5], "stop") == "a"
    assert cut.final_text([0, 5], "length") == "af"  # the max_tokens-th token is text, whatever its id


def test_stop_reason_names_the_stop_id_or_string_as_vllm():
    params = SamplingParams(max_tokens=10, stop_token_ids=[2, 5], stop=["dd"])
    checker = StopChecker(params, 10, frozenset({2}), _letters)
    assert checker.check([0, 2]) == "stop" and checker.stop_reason([0, 2], "stop") is None  # EOS first
    checker = StopChecker(params, 10, frozenset({2}), _letters)
    assert checker.check([0, 5]) == "stop" and checker.stop_reason([0, 5], "stop") == 5
    ignoring = StopChecker(SamplingParams(max_tokens=10, stop_token_ids=[2], ignore_eos=True), 10, frozenset({2}),
                           _letters)
    assert ignoring.check([2]) == "stop" and ignoring.stop_reason([2], "stop") == 2
    checker = StopChecker(params, 10, frozenset({2}), _letters)
    assert _feed(checker, [0, 3, 3]) == (3, "stop") and checker.stop_reason([0, 3, 3], "stop") == "dd"
    assert checker.stop_reason([0, 3, 3], "length") is None


def test_length():
    state = StopChecker(SamplingParams(max_tokens=3), 3, frozenset(), _letters)
    assert state.check([0, 1]) is None
    assert state.check([0, 1, 3]) == "length"
    assert state.final_text([0, 1, 3], "length") == "abd"


def test_stop_string_cuts_text():
    cut = StopChecker(SamplingParams(max_tokens=10, stop=["cd"]), 10, frozenset(), _letters)
    assert _feed(cut, [0, 1, 2, 3, 4]) == (4, "stop")  # "abcd": found at the token that completes it
    assert cut.final_text([0, 1, 2, 3], "stop") == "ab"
    keep = StopChecker(SamplingParams(max_tokens=10, stop=["cd"], include_stop_str_in_output=True), 10,
                       frozenset(), _letters)
    assert _feed(keep, [0, 1, 2, 3, 4]) == (4, "stop")
    assert keep.final_text([0, 1, 2, 3], "stop") == "abcd"


def test_stop_string_spanning_tokens_and_the_list_order():
    pieces = {0: "ab", 1: "c ", 2: "de", 3: "xy", 4: "zz"}

    def decode(ids):
        return "".join(pieces[i] for i in ids)

    span = StopChecker(SamplingParams(max_tokens=10, stop=["c d", "zz"]), 10, frozenset(), decode)
    assert _feed(span, [3, 0, 1, 2, 4]) == (4, "stop")  # "xyabc de": "c d" spans tokens 2 and 3
    assert span.stop_text == "xyab"
    # Two stop strings completed by the same token: the first in the stop list wins (vLLM's
    # check_stop_strings), not the one that starts first in the text.
    first = StopChecker(SamplingParams(max_tokens=10, stop=["de", "c de"]), 10, frozenset(), decode)
    assert _feed(first, [0, 1, 2]) == (3, "stop")
    assert (first.stop_text, first.stop_string) == ("abc ", "de")
    other = StopChecker(SamplingParams(max_tokens=10, stop=["c de", "de"]), 10, frozenset(), decode)
    assert _feed(other, [0, 1, 2]) == (3, "stop")
    assert (other.stop_text, other.stop_string) == ("ab", "c de")


def _bytes_decode(ids):
    """A byte-level tokenizer: token i is byte i (what BPE tokenizers do with rare characters)."""
    return bytes(ids).decode("utf-8", errors="replace")


def test_multi_byte_character_split_over_tokens():
    token_ids = list("x café!".encode())  # é is two tokens (0xC3 0xA9)
    checker = StopChecker(SamplingParams(max_tokens=20, stop=["é"]), 20, frozenset(), _bytes_decode)
    assert _feed(checker, token_ids) == (token_ids.index(0xA9) + 1, "stop")  # not before its last byte
    assert checker.stop_text == "x caf"
    keep = StopChecker(SamplingParams(max_tokens=20, stop=["é!"], include_stop_str_in_output=True), 20,
                       frozenset(), _bytes_decode)
    assert _feed(keep, token_ids) == (len(token_ids), "stop")
    assert keep.stop_text == "x café!"
    text = IncrementalText(_bytes_decode)
    assert text.text(token_ids[:5]) == ("x caf", 5)
    assert text.text(token_ids[:6]) == ("x caf\ufffd", 5)  # the half character is not final yet
    assert text.text(token_ids[:7]) == ("x café", 6)


def test_decodes_only_the_newest_tokens():
    calls = []

    def decode(ids):
        calls.append(len(ids))
        return _letters(ids)

    checker = StopChecker(SamplingParams(max_tokens=400, stop=["zzz"]), 400, frozenset(), decode)
    assert _feed(checker, [i % 20 for i in range(400)]) == (400, "length")
    assert max(calls) <= 2  # the lookback token and the new one, not the whole output


def _full_decode_stop(token_ids, params, decode):
    """The stop-string rule on the whole text at every token (the reference): at the first token
    after which a stop string is in the text, the first such string in list order."""
    for end in range(1, len(token_ids) + 1):
        text = decode(token_ids[:end])
        stop = next((s for s in params.stop if s in text), None)
        if stop is not None:
            return end, text[:text.find(stop) + (len(stop) if params.include_stop_str_in_output else 0)]
    return None, None


@pytest.fixture(scope="module")
def default_tokenizer(session_default_llm):
    # The default model's tokenizer (load_tokenizer(describe_model(None).tokenizer_source)), as the
    # session's default engine loaded it.
    return session_default_llm.engine.tokenizer


@pytest.mark.default_model
def test_equals_the_full_decode_on_the_default_tokenizer(default_tokenizer):
    decode = default_tokenizer.decode
    texts = ["The café in Zürich serves crème brûlée, 3.14 € each! 日本語のテキスト 🙂 and more.\n\n"
             "def f(x):\n    return x ** 2  # ok", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10 — done…"]
    rng = random.Random(0)
    vocab_size = len(default_tokenizer.hf)
    sequences = [default_tokenizer.encode_prompt(t) for t in texts]
    sequences += [[rng.randrange(vocab_size) for _ in range(60)] for _ in range(3)]
    num_stopped = 0
    for token_ids in sequences:
        full = decode(token_ids)
        for _ in range(12):
            start = rng.randrange(len(full) - 6)
            stops = [full[start:start + rng.randint(1, 5)], full[rng.randrange(len(full) - 3):][:3]]
            stops = [s for s in stops if "\ufffd" not in s]
            for include in (False, True):
                params = SamplingParams(max_tokens=1000, stop=stops, include_stop_str_in_output=include)
                checker = StopChecker(params, 1000, frozenset(), decode)
                end, reason = _feed(checker, token_ids)
                want_end, want_text = _full_decode_stop(token_ids, params, decode)
                assert (end if reason == "stop" else None, checker.stop_text) == (want_end, want_text), stops
                num_stopped += reason == "stop"
    assert num_stopped >= 100
