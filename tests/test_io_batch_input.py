"""The OpenAI-Batch input parser: valid shapes and one error per bad line."""

import json

import pytest
import torch
from io_helpers import parse_lines

from batchllm.io.batch_input import BatchError, BatchRequest
from batchllm.engine.sampler import SamplingBatch, sample, sampling_row
from batchllm.io.request_fields import HARMLESS_FIELDS, HONOURED_FIELDS, NO_OP_VALUES, FieldWarning


def _parse(*objects):
    lines = [o if isinstance(o, (str, bytes)) else json.dumps(o) for o in objects]
    return list(parse_lines(lines))


def test_envelope_chat_and_completion_and_short_form():
    items = _parse(
        {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5,
                  "temperature": 0, "stop": "\n", "seed": 3}},
        {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "top_p": 0.5}},
        {"custom_id": "c", "prompt_token_ids": [1, 2, 3], "max_tokens": 7, "ignore_eos": True},
    )
    assert [type(i) for i in items] == [BatchRequest] * 3
    a, b, c = items
    assert a.endpoint == "chat" and a.messages == ({"role": "user", "content": "hi"},)
    assert a.sampling.max_tokens == 5 and a.sampling.temperature == 0 and a.sampling.stop == ("\n",)
    assert a.sampling.seed == 3 and a.warnings == ()  # "model" is accepted silently
    assert b.endpoint == "completion" and b.prompt == "x" and b.sampling.top_p == 0.5
    assert b.sampling.max_tokens == 16  # OpenAI completions default
    assert c.prompt_token_ids == (1, 2, 3) and c.sampling.max_tokens == 7 and c.sampling.ignore_eos


def test_chat_without_max_tokens_runs_to_context():
    (item,) = _parse({"custom_id": "a", "messages": [{"role": "user", "content": "hi"}]})
    assert item.sampling.max_tokens is None


def test_each_bad_line_is_one_error_and_the_rest_parse():
    items = _parse(
        "{not json",
        {"prompt": "no id"},
        {"custom_id": "u", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
        {"custom_id": "m", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}},
        {"custom_id": "nb", "method": "POST", "url": "/v1/completions"},
        {"custom_id": "np", "method": "POST", "url": "/v1/completions", "body": {"max_tokens": 3}},
        {"custom_id": "e", "prompt": ""},
        {"custom_id": "neg", "prompt": "x", "max_tokens": -1},
        {"custom_id": "t", "prompt": "x", "temperature": -0.5},
        {"custom_id": "p", "prompt": "x", "top_p": 1.5},
        {"custom_id": "n", "prompt": "x", "n": 0},
        {"custom_id": "ok", "prompt": "fine"},
        {"custom_id": "ok", "prompt": "dup"},
        b"\xff\xfe{}",
        "   ",
    )
    codes = [(i.code, i.line_number) if isinstance(i, BatchError) else ("ok", i.line_number) for i in items]
    assert codes == [
        ("invalid_json", 1), ("missing_custom_id", 2), ("invalid_url", 3), ("invalid_method", 4),
        ("missing_body", 5), ("missing_prompt", 6), ("empty_prompt", 7), ("invalid_sampling", 8),
        ("invalid_sampling", 9), ("invalid_sampling", 10), ("invalid_sampling", 11), ("ok", 12),
        ("duplicate_custom_id", 13), ("invalid_utf8", 14),
    ]
    assert items[10].message == "n must be an integer in [1, 128], got 0"
    assert items[2].custom_id == "u"  # errors keep the custom_id where there is one


def test_unknown_body_fields_are_refused_and_unknown_envelope_fields_are_warnings():
    body_typo, envelope_extra, short_typo = _parse(
        {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "temprature": 0}},
        {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}, "note": 1},
        {"custom_id": "c", "prompt": "x", "frobnicate": 1},
    )
    assert (body_typo.code, body_typo.custom_id) == ("unknown_field", "a")
    assert body_typo.message.startswith('unknown field "temprature"') and "remove it" in body_typo.message
    assert isinstance(envelope_extra, BatchRequest)
    assert envelope_extra.warnings == (FieldWarning("note", "not a field of an OpenAI Batch line "
                                                    "(custom_id, method, url, body)"),)
    assert short_typo.code == "unknown_field" and '"frobnicate"' in short_typo.message


def test_harmless_fields_warn_only_when_set_away_from_their_default():
    quiet, noted = _parse(
        {"custom_id": "a", "prompt": "x", "model": "gpt-x", "user": "", "stream": False, "store": False,
         "metadata": {}, "service_tier": "auto", "parallel_tool_calls": True, "priority": 0},
        {"custom_id": "b", "prompt": "x", "user": "u1", "stream": True, "metadata": {"k": "v"}},
    )
    assert quiet.warnings == ()
    assert [str(w) for w in noted.warnings] == [
        "'user' ignored: an end-user id for a hosted API",
        "'stream' ignored: batch results are written whole",
        "'metadata' ignored: labels for a hosted API's dashboard"]


HUGE_INTEGERS = [2**31, 2**63, 2**64, -2**63 - 1, 10**26, 10**400, -10**400]


def test_an_integer_past_the_int_string_limit_anywhere_is_invalid_json():
    digits = "7" * 5000  # past Python's 4300-digit conversion limit: json.loads raises ValueError
    lines = [f'{{"custom_id": "a", "prompt": "x", "seed": {digits}}}',
             f'{{"custom_id": "b", "prompt": "x", "metadata": {{"k": [{digits}]}}}}',
             f'{{"custom_id": {digits}, "prompt": "x"}}']
    errors = _parse(*lines)
    assert [e.code for e in errors] == ["invalid_json"] * 3
    assert "integer of more than 4300 digits" in errors[0].message


@pytest.mark.parametrize("field", sorted(set(HONOURED_FIELDS) | set(NO_OP_VALUES) | set(HARMLESS_FIELDS)))
def test_out_of_range_integers_in_any_field_are_typed_errors(field):
    """Every known field, given integers past int32/int64/float range (as a value, in a list and
    as a logit_bias key), is answered with a typed error or accepted and samples; never internal_error."""
    values = [*HUGE_INTEGERS, [2**64], {"1": 10**400}, {str(10**26): 1}]
    for value in values:
        (item,) = _parse({"custom_id": "a", "prompt_token_ids": [1, 2], field: value})
        if isinstance(item, BatchError):
            assert item.code in ("invalid_sampling", "invalid_request", "unsupported_feature", "empty_prompt"), \
                (field, value, item)
            assert len(item.message) < 200, item.message
            continue
        row = sampling_row(item.sampling, 0, 0)
        sample(torch.zeros(1, 8), SamplingBatch.build([row], torch.device("cpu")))


def test_logit_bias_keys_and_values_out_of_range_name_the_field():
    key_26, key_long, value_huge, temperature_huge = _parse(
        {"custom_id": "a", "prompt": "x", "logit_bias": {str(10**26): 1}},
        {"custom_id": "b", "prompt": "x", "logit_bias": {"9" * 4000: 1}},
        {"custom_id": "c", "prompt": "x", "logit_bias": {"5": 10**400}},
        {"custom_id": "d", "prompt": "x", "temperature": 10**400},
    )
    assert key_26.code == "invalid_sampling"
    assert key_26.message.startswith("logit_bias keys must be token ids (integers in [0, 2147483647])")
    assert key_long.code == "invalid_sampling" and len(key_long.message) < 120
    assert value_huge.code == "invalid_sampling"
    assert value_huge.message == "logit_bias['5'] must be a number in [-100, 100], got an integer of about 400 digits"
    assert temperature_huge.code == "invalid_sampling"
    assert temperature_huge.message == "temperature must be a finite number >= 0, got an integer of about 400 digits"
