"""The OpenAI-Batch input parser: valid shapes and one error per bad line."""

import json

from io_helpers import parse_lines

from batchllm.io.batch_input import BatchError, BatchRequest


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
        {"custom_id": "n", "prompt": "x", "n": 2},
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
    assert "n=2 is not supported" in items[10].message
    assert items[2].custom_id == "u"  # errors keep the custom_id where there is one


def test_unknown_fields_are_warnings_not_errors():
    (item,) = _parse({"custom_id": "a", "prompt": "x", "frobnicate": 1})
    assert isinstance(item, BatchRequest)
    assert item.warnings == ("unknown field 'frobnicate' ignored",)
