"""n, best_of and return_token_ids as a batch line gives them (torch-free parsing), and the seeds
of a request's samples."""

import pytest

from batchllm.io.batch_input import BatchError, BatchRequest, parse_request_object
from batchllm.io.request_fields import HONOURED_FIELDS, NO_OP_VALUES
from batchllm.sampling_params import MAX_NUM_SAMPLES, SamplingParams, SamplingParamsError, sample_seed


def _parse(**fields):
    try:
        return parse_request_object({"custom_id": "a", "prompt_token_ids": [5, 6], **fields}, 1)
    except Exception as error:  # RequestError: code and message
        return error


def test_n_is_honoured_from_1_to_the_bound():
    assert _parse(n=3).sampling.n == 3 and _parse().sampling.n == 1 and _parse(n=None).sampling.n == 1
    assert _parse(n=MAX_NUM_SAMPLES).sampling.n == MAX_NUM_SAMPLES == 128
    for bad in (0, -1, MAX_NUM_SAMPLES + 1):
        error = _parse(n=bad)
        assert (error.code, str(error)) == ("invalid_sampling", f"n must be an integer in [1, 128], got {bad}")
    assert _parse(n=True).code == "invalid_sampling" and _parse(n=2.0).code == "invalid_sampling"
    with pytest.raises(SamplingParamsError, match=r"n must be an integer in \[1, 128\], got 0"):
        SamplingParams(n=0)


def test_best_of_equal_to_n_or_absent_is_accepted_anything_else_refused():
    assert "best_of" in HONOURED_FIELDS and "best_of" not in NO_OP_VALUES
    assert _parse(n=3, best_of=3).sampling.n == 3 and _parse(best_of=1).sampling.n == 1
    assert _parse(n=2, best_of=None).sampling.n == 2
    error = _parse(n=2, best_of=4)
    assert (error.code, str(error)) == ("unsupported_feature", "best_of=4 with n=2 is not supported: every sample "
                                        "is returned, so set best_of to n (2) or remove it")
    assert str(_parse(best_of=2)) == ("best_of=2 with n=1 is not supported: every sample is returned, so set "
                                      "best_of to n (1) or remove it")
    assert _parse(n=2, best_of=0).code == "invalid_sampling"


def test_return_token_ids_is_honoured_and_a_boolean():
    assert "return_token_ids" in HONOURED_FIELDS and "return_token_ids" not in NO_OP_VALUES
    assert _parse().return_token_ids is None  # the model decides: on without a tokenizer
    assert _parse(return_token_ids=True).return_token_ids is True
    assert _parse(return_token_ids=False).return_token_ids is False
    error = _parse(return_token_ids=1)
    assert (error.code, str(error)) == ("invalid_sampling", "return_token_ids must be true or false, got 1")
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"prompt_token_ids": [5], "n": 2, "best_of": 2, "return_token_ids": True}}
    parsed = parse_request_object(line, 4)
    assert isinstance(parsed, BatchRequest) and not isinstance(parsed, BatchError)
    assert (parsed.endpoint, parsed.sampling.n, parsed.return_token_ids) == ("chat", 2, True)


def test_sample_seeds_keep_sample_0_and_differ_in_the_bits_the_sampler_reads():
    assert sample_seed(7, 0) == 7 and sample_seed(-3, 0) == -3
    seeds = [sample_seed(7, k) for k in range(1, 129)]
    assert seeds == [sample_seed(7, k) for k in range(1, 129)]  # a pure function
    assert len({s & 0xFFFFFFFF for s in seeds} | {7}) == 129  # the sampler reads the low 32 bits
    assert all(0 <= s < 2**63 for s in seeds + [sample_seed(-3, 1), sample_seed(2**63 - 1, 5)])
    assert sample_seed(7, 1) != sample_seed(8, 1)
    assert sample_seed(0, 1) == 0xE220A8397B1DCDAF >> 1  # splitmix64's first output from state 0, to 63 bits
