"""Stop conditions: EOS, stop ids, stop strings, length."""

from batchllm.engine.stop_checker import StopState
from batchllm.sampling_params import SamplingParams


def _decode(ids):
    return "".join(chr(ord("a") + i) for i in ids)


def test_eos_and_stop_ids_and_ignore_eos():
    state = StopState(SamplingParams(max_tokens=10), 10, frozenset({2}))
    assert state.check([0, 1], 1, _decode) is None
    assert state.check([0, 1, 2], 2, _decode) == "stop"
    assert state.final_token_ids_for_text([0, 1, 2], "stop") == [0, 1]
    ignoring = StopState(SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[5]), 10, frozenset({2}))
    assert ignoring.check([2], 2, _decode) is None
    assert ignoring.check([2, 5], 5, _decode) == "stop"
    assert ignoring.final_token_ids_for_text([2, 5], "stop") == [2]


def test_length():
    state = StopState(SamplingParams(max_tokens=3), 3, frozenset())
    assert state.check([0, 1], 1, _decode) is None
    assert state.check([0, 1, 3], 3, _decode) == "length"


def test_stop_string_cuts_text():
    state = StopState(SamplingParams(max_tokens=10, stop=["cd"]), 10, frozenset())
    assert state.check([0, 1], 1, _decode) is None  # "ab"
    assert state.check([0, 1, 2, 3, 4], 4, _decode) == "stop"  # "abcde"
    assert state.final_text("abcde") == "ab"
    keep = StopState(SamplingParams(max_tokens=10, stop=["cd"], include_stop_str_in_output=True), 10, frozenset())
    assert keep.check([0, 1, 2, 3], 3, _decode) == "stop"
    assert keep.final_text("abcd") == "abcd"
