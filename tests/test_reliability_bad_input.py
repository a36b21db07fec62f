"""A file with every kind of bad line; the valid lines are answered, each invalid line
gets exactly one error record (in the output and in --errors), and the exit code is 0.
Failures where nothing can run exit 2 with a one-line message naming the cause and the fix."""

import json

import pytest

from batchllm.cli.main import main

MODEL = "random:tiny"  # vocab 512, context 2048, no tokenizer: token-id prompts only
KV_TOKENS = 256  # so a 300-token prompt does not fit and prompt + max_tokens gets clamped
ENVELOPE = {"method": "POST", "url": "/v1/completions"}


def _ids(n, start=3):
    return [start + (i % 400) for i in range(n)]


# (input line, expected code or "ok", what it checks); None = blank line (no record).
CASES = [
    ({"custom_id": "ok1", "prompt_token_ids": _ids(5), "max_tokens": 3, "temperature": 0}, "ok", "valid"),
    ("{not json", "invalid_json", "malformed JSON"),
    ({"prompt_token_ids": [5, 6]}, "missing_custom_id", "missing custom_id"),
    ({"custom_id": "ok1", "prompt_token_ids": [7, 8]}, "duplicate_custom_id", "duplicate custom_id"),
    ({"custom_id": "u", **ENVELOPE, "url": "/v1/embeddings", "body": {"input": "x"}}, "invalid_url", "unknown url"),
    ({"custom_id": "m", **ENVELOPE, "method": "GET", "body": {"prompt": [5]}}, "invalid_method", "unknown method"),
    ({"custom_id": "nb", **ENVELOPE}, "missing_body", "missing body"),
    ({"custom_id": "np", **ENVELOPE, "body": {"max_tokens": 3}}, "missing_prompt", "missing prompt"),
    ({"custom_id": "nm", "method": "POST", "url": "/v1/chat/completions", "body": {"max_tokens": 3}},
     "missing_prompt", "missing messages"),
    ({"custom_id": "e1", "prompt": ""}, "empty_prompt", "empty prompt"),
    ({"custom_id": "e2", "prompt_token_ids": []}, "empty_prompt", "empty token ids"),
    ({"custom_id": "e3", "messages": [{"role": "user", "content": ""}]}, "empty_prompt", "empty messages"),
    ({"custom_id": "s1", "prompt_token_ids": [5], "max_tokens": -1}, "invalid_sampling", "negative max_tokens"),
    ({"custom_id": "s2", "prompt_token_ids": [5], "temperature": -0.5}, "invalid_sampling", "temperature < 0"),
    ({"custom_id": "s3", "prompt_token_ids": [5], "top_p": 0}, "invalid_sampling", "top_p = 0"),
    ({"custom_id": "s4", "prompt_token_ids": [5], "top_p": 1.5}, "invalid_sampling", "top_p > 1"),
    ({"custom_id": "s5", "prompt_token_ids": [5], "n": 129}, "invalid_sampling", "n above 128"),
    ({"custom_id": "s6", "prompt_token_ids": [5], "temperature": "hot"}, "invalid_sampling", "temperature string"),
    ({"custom_id": "typo", "prompt_token_ids": _ids(4), "max_tokens": 2, "temperature": 0, "frobnicate": 1},
     "unknown_field", "unknown body field: refused"),
    ({"custom_id": "bo", "prompt_token_ids": _ids(4), "best_of": 2}, "unsupported_feature",
     "a field not implemented, set: refused"),
    ({"custom_id": "unk", **ENVELOPE, "note": 1, "body": {"prompt": _ids(4), "max_tokens": 2, "temperature": 0,
                                                         "user": "u1", "presence_penalty": 0}},
     "ok", "unknown envelope field, a harmless field, a field at its no-op value: warnings"),
    ({"custom_id": "long", "prompt_token_ids": _ids(300)}, "prompt_too_long", "prompt longer than the context"),
    ({"custom_id": "clamp", "prompt_token_ids": _ids(200), "max_tokens": 1000, "temperature": 0, "ignore_eos": True},
     "ok", "prompt + max_tokens beyond the context: clamped"),
    ({"custom_id": "vocab", "prompt_token_ids": [5, 600]}, "invalid_request", "token id >= vocab size"),
    ({"custom_id": "huge", "prompt_token_ids": [5, 2**40]}, "invalid_request", "token id beyond int32"),
    ({"custom_id": "text", "prompt": "hello"}, "invalid_request", "text prompt, model without tokenizer"),
    (b'{"custom_id": "bytes", "prompt": "caf\xe9"}', "invalid_utf8", "invalid UTF-8"),
    ('{"custom_id": "sur", "prompt": "\\ud800"}', "invalid_unicode", "lone surrogate escape"),
    ({"custom_id": ["x"], "prompt_token_ids": [5]}, "invalid_custom_id", "custom_id not a string"),
    ([1, 2, 3], "invalid_request", "not an object"),
    (None, None, "blank line: skipped"),
    ("   ", None, "whitespace line: skipped"),
    ({"custom_id": 42, "prompt_token_ids": _ids(6), "max_tokens": 2, "temperature": 0}, "ok", "integer custom_id"),
    ({"custom_id": "pp", "prompt_token_ids": _ids(4), "presence_penalty": 2.5}, "invalid_sampling",
     "presence_penalty outside [-2, 2]"),
    ({"custom_id": "rp", "prompt_token_ids": _ids(4), "repetition_penalty": 0}, "invalid_sampling",
     "repetition_penalty not > 0"),
    ({"custom_id": "mt", "prompt_token_ids": _ids(4), "max_tokens": 2, "min_tokens": 3}, "invalid_sampling",
     "min_tokens > max_tokens"),
    ({"custom_id": "pen", "prompt_token_ids": _ids(4), "max_tokens": 3, "temperature": 0, "presence_penalty": 0.5,
      "frequency_penalty": -0.5, "repetition_penalty": 1.3, "min_tokens": 2}, "ok", "penalties and min_tokens: run"),
]


def _write_input(path):
    with open(path, "wb") as handle:
        for line, _, _ in CASES:
            if line is None:
                data = b""
            elif isinstance(line, bytes):
                data = line
            elif isinstance(line, str):
                data = line.encode()
            else:
                data = json.dumps(line).encode()
            handle.write(data + b"\n")


def test_every_bad_line_is_one_error_record_and_the_job_completes(tmp_path, capsys):
    input_path, output_path, errors_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    _write_input(input_path)
    code = main(["run", str(input_path), "-o", str(output_path), "--errors", str(errors_path), "--model", MODEL,
                 "--kv-cache-tokens", str(KV_TOKENS), "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    records = [json.loads(line) for line in output_path.read_text(encoding="utf-8").splitlines()]
    expected = [(line_number, expect, why) for line_number, (_, expect, why) in enumerate(CASES, start=1)
                if expect is not None]
    assert len(records) == len(expected)  # one record per non-blank line, none for blank lines
    for record, (line_number, expect, why) in zip(records, expected):
        if expect == "ok":
            assert record["error"] is None and record["response"]["status_code"] == 200, why
        else:
            assert record["response"] is None, why
            assert (record["error"]["code"], record["error"]["line"]) == (expect, line_number), why
            assert record["error"]["message"], why
    by_id = {r["custom_id"]: r for r in records if r["error"] is None}
    assert sorted(by_id) == ["42", "clamp", "ok1", "pen", "unk"]
    assert by_id["pen"]["response"]["body"]["usage"]["completion_tokens"] == 3
    usage = by_id["clamp"]["response"]["body"]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (200, KV_TOKENS - 16 - 200)
    assert by_id["ok1"]["response"]["body"]["usage"]["completion_tokens"] == 3
    # errors keep their custom_id where the line had a usable one; otherwise only the line
    codes = {(r["custom_id"], r["error"]["code"]) for r in records if r["error"]}
    assert ("ok1", "duplicate_custom_id") in codes and (None, "invalid_json") in codes
    assert (None, "invalid_utf8") in codes and (None, "missing_custom_id") in codes
    errors = [json.loads(line) for line in errors_path.read_text(encoding="utf-8").splitlines()]
    assert errors == [r for r in records if r["error"] is not None]
    assert "5 requests answered, 30 errors" in captured.out
    assert captured.err.count("warning:") == 2  # one summary line per field, not one per line
    assert ("warning: 1 line had 'note' ignored: not a field of an OpenAI Batch line (custom_id, method, url, body) "
            "(first: line 21)") in captured.err
    assert "warning: 1 line had 'user' ignored: an end-user id for a hosted API (first: line 21)" in captured.err
    assert not (tmp_path / "out.jsonl.partial").exists()


def test_finish_order_keeps_the_same_records(tmp_path, capsys):
    input_path = tmp_path / "in.jsonl"
    _write_input(input_path)
    outputs = {}
    for order in ("input", "finish"):
        path = tmp_path / f"{order}.jsonl"
        assert main(["run", str(input_path), "-o", str(path), "--model", MODEL, "--kv-cache-tokens", str(KV_TOKENS),
                     "--no-progress", "--order", order]) == 0
        outputs[order] = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    capsys.readouterr()
    key = lambda r: (r["custom_id"] or "", (r["error"] or {}).get("line", 0))  # noqa: E731
    assert sorted(map(key, outputs["input"])) == sorted(map(key, outputs["finish"]))
    # finish order: every error record is written when its line is read, before the window runs
    first_answer = next(i for i, r in enumerate(outputs["finish"]) if r["error"] is None)
    assert all(r["error"] is None for r in outputs["finish"][first_answer:])


@pytest.mark.parametrize("argv, message", [
    (["--model", "/nonexistent/model.gguf"], "cannot load the model"),
    (["--model", "random:no-such-preset"], "cannot load the model"),
])
def test_bad_model_exits_2_with_one_line(tmp_path, capsys, argv, message):
    input_path = tmp_path / "in.jsonl"
    input_path.write_text(json.dumps({"custom_id": "a", "prompt_token_ids": [5]}) + "\n")
    assert main(["run", str(input_path), "-o", str(tmp_path / "out.jsonl"), "--no-progress", *argv]) == 2
    error_lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and message in error_lines[0] and "fix:" in error_lines[0]


def test_unreadable_input_exits_2(tmp_path, capsys):
    assert main(["run", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--model", MODEL]) == 2
    assert "not found (fix: check the path)" in capsys.readouterr().err
    assert main(["run", str(tmp_path), "-o", str(tmp_path / "out.jsonl"), "--model", MODEL]) == 2
    assert "is not a file" in capsys.readouterr().err
