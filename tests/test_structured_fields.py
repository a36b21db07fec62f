"""The structured-output request fields -> StructuredOutputsParams, or a typed error on the line
(batchllm/io/structured_fields.py; torch-free)."""

from __future__ import annotations

import json

import pytest
from io_helpers import parse_lines

from batchllm.io.batch_input import BatchError, BatchRequest
from batchllm.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["a"]}


def _parse(endpoint: str = "chat", **fields) -> BatchRequest | BatchError:
    url, prompt = {"chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                   "completion": ("/v1/completions", {"prompt": "hi"})}[endpoint]
    line = {"custom_id": "a", "method": "POST", "url": url, "body": {**prompt, **fields}}
    (item,) = parse_lines([json.dumps(line)])
    return item


def _spec(**fields) -> StructuredOutputsParams:
    item = _parse(**fields)
    assert isinstance(item, BatchRequest), item
    return item.sampling.structured_outputs


def test_openai_response_format_json_schema_and_json_object():
    spec = _spec(response_format={"type": "json_schema", "json_schema": {
        "name": "thing", "schema": SCHEMA, "strict": True, "description": "a thing"}})
    # held as JSON text with the schema's key order (it is the order of the output's properties)
    assert spec == StructuredOutputsParams(json='{"type": "object", "properties": {"b": {"type": "integer"}, '
                                                '"a": {"type": "string"}}, "required": ["a"]}')
    assert (spec.kind, spec.source) == ("json", "response_format")
    strict_false = _spec(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                                                  "strict": False}})
    assert strict_false == spec
    assert _spec(response_format={"type": "json_object"}) == StructuredOutputsParams(json_object=True)
    assert _spec(response_format={"type": "text"}) is None
    assert _spec(endpoint="completion", response_format={"type": "json_object"}).kind == "json_object"


def test_vllm_guided_fields_and_structured_outputs():
    assert _spec(guided_json=SCHEMA) == _spec(guided_json=json.dumps(SCHEMA)) == StructuredOutputsParams(json=SCHEMA)
    assert _spec(guided_regex="[0-9]+") == StructuredOutputsParams(regex="[0-9]+")
    assert _spec(guided_choice=["yes", "no"]) == StructuredOutputsParams(choice=("yes", "no"))
    assert _spec(guided_grammar='root ::= "a"') == StructuredOutputsParams(grammar='root ::= "a"')
    assert _spec(guided_decoding_backend="xgrammar", guided_regex="a").regex == "a"
    spec = _spec(structured_outputs={"json": SCHEMA, "disable_any_whitespace": True,
                                     "disable_additional_properties": True, "whitespace_pattern": None})
    assert spec == StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    assert spec.source == "structured_outputs"
    assert _spec(structured_outputs={"choice": ["x"]}) == StructuredOutputsParams(choice=("x",))
    assert _spec(structured_outputs={"json_object": True}).kind == "json_object"
    assert _spec(guided_json=None, guided_regex=None, structured_outputs=None) is None


@pytest.mark.parametrize("fields, code, message", [
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "invalid_request",
     "give only one of guided_json, guided_regex: each constrains the whole answer"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "invalid_request",
     "give only one of response_format, structured_outputs: each constrains the whole answer"),
    ({"response_format": {"type": "xml"}}, "invalid_request",
     "response_format type must be text, json_object or json_schema, got 'xml'"),
    ({"response_format": "json"}, "invalid_request",
     "response_format must be an object with a type: text, json_object or json_schema, got 'json'"),
    ({"response_format": {"type": "structural_tag", "format": {}}}, "unsupported_feature",
     "response_format type structural_tag is not supported: use json_schema, json_object or text"),
    ({"response_format": {"type": "json_schema"}}, "invalid_request",
     'response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "invalid_request",
     'response_format.json_schema has no schema: give "schema": {...} (or use type json_object for any JSON '
     'object)'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": 1}}},
     "invalid_request", "response_format.json_schema.strict must be true or false, got 1"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "extra": 1}}},
     "invalid_request", "response_format.json_schema has unknown key 'extra' (known: description, name, schema, "
     "strict)"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "invalid_request",
     "response_format.json_schema.schema must be a JSON schema object, got [1]"),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, "invalid_request",
     "response_format (json_object) has unknown key 'schema' (known: type)"),
    ({"guided_json": "{not json"}, "invalid_request",
     "guided_json is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    ({"guided_choice": "yes"}, "invalid_request", "guided_choice must be a list of strings, got 'yes'"),
    ({"guided_choice": []}, "invalid_request",
     "guided_choice: choice must be a non-empty list of non-empty strings, got ()"),
    ({"guided_choice": ["a", 1]}, "invalid_request",
     "guided_choice: choice must be a non-empty list of non-empty strings, got ('a', 1)"),
    ({"guided_regex": ""}, "invalid_request", "guided_regex: regex must be a non-empty string, got ''"),
    ({"guided_grammar": 5}, "invalid_request", "guided_grammar: grammar must be a non-empty string, got 5"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "invalid_request",
     "structured_outputs must give exactly one of json, regex, choice, grammar, json_object, got regex, choice"),
    ({"structured_outputs": {"json_object": False}}, "invalid_request",
     "structured_outputs: json_object must be true, got False"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "unsupported_feature",
     "structured_outputs.whitespace_pattern is not supported: remove it"),
    ({"structured_outputs": {"regex": "a", "structural_tag": "{}"}}, "unsupported_feature",
     "structured_outputs.structural_tag is not supported: remove it"),
    ({"structured_outputs": {"regex": "a", "backend": "x"}}, "invalid_request",
     "structured_outputs has unknown key 'backend' (known: json, regex, choice, grammar, json_object, ...)"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": "yes"}}, "invalid_request",
     "structured_outputs.disable_any_whitespace must be true or false, got 'yes'"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "unsupported_feature",
     "guided_decoding_backend=\"outlines\" is not supported: remove 'guided_decoding_backend' from the request "
     "(accepted: null, \"auto\", \"xgrammar\")"),
    ({"guided_regex": "a", "ignore_eos": True}, "invalid_sampling",
     "ignore_eos cannot be combined with guided_regex: a structured answer ends with the end-of-sequence token"),
])
def test_bad_structured_fields_are_typed_errors_on_their_line(fields, code, message):
    item = _parse(**fields)
    assert isinstance(item, BatchError)
    assert (item.code, item.message, item.custom_id) == (code, message, "a")


def test_sampling_params_hold_a_hashable_structured_output():
    spec = StructuredOutputsParams(json={"type": "object"}, source="guided_json")
    params = SamplingParams(structured_outputs=spec)
    assert hash(params) == hash(SamplingParams(structured_outputs=StructuredOutputsParams(json='{"type": "object"}')))
    with pytest.raises(SamplingParamsError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})
    with pytest.raises(SamplingParamsError, match="must give exactly one of"):
        StructuredOutputsParams()
