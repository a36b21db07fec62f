"""Structured outputs on the default model (SmolLM2-135M-Instruct, float32 on the CPU): answers
over twenty realistic JSON schemas parse and validate, regex and choice answers match, and a bad
schema is refused on its line while the other lines are answered."""

from __future__ import annotations

import json
import re

import pytest
from jsonschema import Draft202012Validator, FormatChecker
from model_helpers import normalized_records
from structured_schemas import SCHEMAS

from batchllm.cli.main import main
from batchllm.sampling_params import SamplingParams, StructuredOutputsParams
from batchllm.structured.errors import StructuredOutputError

pytest_plugins = ["model_fixtures"]

MAX_TOKENS = 256  # room for every schema's answer; an answer that needs more ends with "length"
NUM_JSON_REQUESTS = 40  # two per schema in CI (the 200-request run: README, "Structured outputs")


def _validate(schema: dict, text: str) -> None:
    Draft202012Validator(schema, format_checker=FormatChecker()).validate(json.loads(text))


def json_schema_batch(num_requests: int) -> tuple[list[list[dict]], list[SamplingParams], list[dict]]:
    """Requests cycling over SCHEMAS, half greedy and half sampled (seeded)."""
    conversations, params, schemas = [], [], []
    for index in range(num_requests):
        prompt, schema = SCHEMAS[index % len(SCHEMAS)]
        conversations.append([{"role": "user", "content": f"{prompt} Answer in JSON."}])
        params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0 if index % 2 == 0 else 0.7, seed=index,
                                     structured_outputs=StructuredOutputsParams(json=schema)))
        schemas.append(schema)
    return conversations, params, schemas


@pytest.mark.default_model
def test_answers_over_twenty_json_schemas_parse_and_validate(default_llm):
    conversations, params, schemas = json_schema_batch(NUM_JSON_REQUESTS)
    outputs = default_llm.chat(conversations, params, use_tqdm=False)  # one engine batch
    assert default_llm.last_run_stats.num_requests == NUM_JSON_REQUESTS
    for output, schema in zip(outputs, schemas):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        _validate(schema, completion.text)
    assert json.loads(outputs[0].outputs[0].text) == {"name": "Ann Lee", "age": 31, "city": "Norway"}  # greedy


REGEXES = [
    ("What is the date of the first moon landing? Answer as YYYY-MM-DD.", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
    ("Give a US phone number.", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"),
    ("Give a product code.", r"[A-Z]{3}-[0-9]{3}"),
    ("Is water wet? Answer yes or no, then explain in a few words.", r"(yes|no), [a-z ]{5,40}\."),
    ("Give an email address for Alice.", r"[a-z]{2,12}@[a-z]{2,12}\.(com|org)"),
]
CHOICES = [
    ("Classify the sentiment of 'I love this phone'.", ("positive", "negative", "neutral")),
    ("Which is a fruit?", ("apple", "car", "house")),
    ("What colour is the sky on a clear day?", ("blue", "green", "red")),
    ("Is the statement 'two plus two is five' true?", ("true", "false")),
    ("Pick the animal.", ("a dog", "a table", "a cloud")),
]


@pytest.mark.default_model
def test_regex_and_choice_answers_match(default_llm):
    conversations, params, checks = [], [], []
    for index in range(20):
        seed, temperature = index, 0.0 if index < 10 else 0.8
        prompt, regex = REGEXES[index % len(REGEXES)]
        conversations.append([{"role": "user", "content": prompt}])
        params.append(SamplingParams(max_tokens=64, temperature=temperature, seed=seed,
                                     structured_outputs=StructuredOutputsParams(regex=regex)))
        checks.append(lambda text, regex=regex: re.fullmatch(regex, text) is not None)
        prompt, choices = CHOICES[index % len(CHOICES)]
        conversations.append([{"role": "user", "content": prompt}])
        params.append(SamplingParams(max_tokens=16, temperature=temperature, seed=seed,
                                     structured_outputs=StructuredOutputsParams(choice=choices)))
        checks.append(lambda text, choices=choices: text in choices)
    outputs = default_llm.chat(conversations, params, use_tqdm=False)
    for output, check in zip(outputs, checks):
        assert output.outputs[0].finish_reason == "stop" and check(output.outputs[0].text), output.outputs[0].text
    # the greedy answers of a 135M model (not always right: the mask makes them valid, not true)
    assert outputs[1].outputs[0].text == "negative" and outputs[3].outputs[0].text == "apple"


@pytest.mark.default_model
def test_a_bad_structured_output_raises_before_anything_runs(default_llm):
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(a", source="guided_regex"))
    before = default_llm.last_run_stats
    with pytest.raises(StructuredOutputError, match="guided_regex: invalid regex: Regex parsing error"):
        default_llm.generate(["Hi", "Hello"], [SamplingParams(max_tokens=2), bad], use_tqdm=False)
    assert default_llm.last_run_stats is before  # nothing ran


def _line(custom_id: str, content: str = "Describe a cat as JSON.", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": content}], "max_tokens": 96, "temperature": 0, **body}}


@pytest.mark.default_model
def test_a_bad_schema_is_refused_on_its_line_and_the_other_lines_answer(tmp_path, capsys, cli_default_engine):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
              "required": ["name", "legs"]}
    lines = [
        _line("schema", response_format={"type": "json_schema", "json_schema": {"name": "cat", "schema": schema,
                                                                                  "strict": True}}),
        _line("bad-schema", response_format={"type": "json_schema", "json_schema": {
            "name": "cat", "schema": {"type": "object", "properties": {"legs": {"type": "integr"}}}}}),
        _line("bad-regex", guided_regex="[0-9"),
        _line("bad-grammar", guided_grammar="root ::= ("),
        _line("object", 'Reply with exactly this JSON object: {"animal": "cat"}', response_format={"type": "json_object"}),
        _line("choice", guided_choice=["cat", "dog"]),
        _line("lark", guided_grammar='start: "meow" | "purr"'),
        _line("free", max_tokens=4),
    ]
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code = main(["run", str(source), "-o", str(output), "--dtype", "float32", "--device", "cpu", "--no-progress"])
    assert code == 0 and len(cli_default_engine) == 1, capsys.readouterr().err
    records = {r["custom_id"]: r for r in normalized_records(output)}
    errors = {custom_id: r["error"] for custom_id, r in records.items() if r["error"] is not None}
    assert {custom_id: e["code"] for custom_id, e in errors.items()} == {
        "bad-schema": "invalid_request", "bad-regex": "invalid_request", "bad-grammar": "invalid_request"}
    assert errors["bad-schema"]["message"] == 'response_format: invalid JSON schema: Unsupported type "integr"'
    assert errors["bad-regex"]["message"].startswith("guided_regex: invalid regex: ")
    assert errors["bad-grammar"]["message"].startswith("guided_grammar: invalid EBNF grammar: EBNF parser error")
    texts = {custom_id: r["response"]["body"]["choices"][0]["message"]["content"]
             for custom_id, r in records.items() if r["error"] is None}
    _validate(schema, texts["schema"])
    assert isinstance(json.loads(texts["object"]), dict)
    assert texts["choice"] in ("cat", "dog") and texts["lark"] in ("meow", "purr")
    finish = {custom_id: r["response"]["body"]["choices"][0]["finish_reason"]
              for custom_id, r in records.items() if r["error"] is None}
    assert finish == {"schema": "stop", "object": "stop", "choice": "stop", "lark": "stop", "free": "length"}
