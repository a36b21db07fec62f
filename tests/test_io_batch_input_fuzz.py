"""Property: the input parser never crashes; every non-blank line gives exactly one item, and
every error can be written as an output line (UTF-8 JSON)."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz import examples
from io_helpers import parse_lines

from batchllm.io.batch_input import BatchError, BatchRequest
from batchllm.io.batch_output import dumps, error_line

_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=8)
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                           max_size=4), max_leaves=12)
_keys = st.sampled_from(["custom_id", "method", "url", "body", "prompt", "messages", "prompt_token_ids",
                         "max_tokens", "temperature", "top_p", "n", "stop", "logprobs", "top_logprobs", "seed",
                         "stop_token_ids", "role", "content", "type", "text", "ignore_eos", "top_k", "min_p"])
_values = _json | st.sampled_from(["POST", "GET", "/v1/chat/completions", "/v1/completions", "user", "\ud800"])
_request_like = st.recursive(
    st.dictionaries(_keys, _values, max_size=6),
    lambda inner: st.dictionaries(_keys, inner | _values | st.lists(inner, max_size=3), max_size=6),
    max_leaves=20,
)


def _check(lines):
    if not lines:
        return
    items = list(parse_lines(lines))
    blank = " \t\r\n" if isinstance(lines[0], str) else b" \t\r\n"
    bom = "\ufeff" if isinstance(lines[0], str) else b"\xef\xbb\xbf"
    lines_without_bom = [lines[0].removeprefix(bom), *lines[1:]]  # a BOM opening the file is not content
    non_blank = [raw for raw in lines_without_bom if raw.strip(blank)]
    assert len(items) == len(non_blank)
    for item in items:
        assert isinstance(item, (BatchRequest, BatchError))
        if isinstance(item, BatchError):
            record = dumps(error_line(item.custom_id, item.code, item.message, item.line_number))
        else:
            record = dumps({"custom_id": item.custom_id})
        record.encode("utf-8")  # never an unencodable surrogate in what we would write
        json.loads(record)


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=60), max_size=6))
def test_random_bytes_never_crash_the_parser(lines):
    lines = [line.replace(b"\n", b" ") for line in lines]
    _check(lines)


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_request_like | _json, min_size=1, max_size=5))
def test_json_garbage_never_crashes_the_parser(objects):
    lines = [json.dumps(obj) for obj in objects]
    _check(lines)


@settings(max_examples=examples(200), deadline=None)
@given(st.text(max_size=80))
def test_random_text_never_crashes_the_parser(text):
    _check([text.replace("\n", " ").replace("\r", " ")])
