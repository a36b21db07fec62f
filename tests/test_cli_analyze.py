"""`batchllm analyze` on token ids (no model, no torch), bad input, groups export."""

import json
import subprocess
import sys

import pytest

from batchllm.cli.main import main

pytest_plugins = ["model_fixtures"]


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


FIG4 = [
    [0, 5, 6],
    [1, 2, 3],
    [1, 4, 5],
    [1, 20, 20, 20, 20, 20, 20, 20, 3, 3],
    [1, 20, 20, 20, 20, 20, 20, 20, 4, 4],
    [1, 7, 7],
]


def _fig4_lines():
    lines = [{"custom_id": f"r{i}", "prompt_token_ids": p, "max_tokens": 5} for i, p in enumerate(FIG4)]
    # the same request in the OpenAI Batch envelope
    lines[5] = {"custom_id": "r5", "method": "POST", "url": "/v1/completions",
                "body": {"prompt": FIG4[5], "max_tokens": 5}}
    return lines


def test_json_summary_pins_fig4(tmp_path, capsys):
    path = _write(tmp_path / "in.jsonl", _fig4_lines())
    assert main(["analyze", path, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["requests"] == 6
    assert summary["logical_prefill_tokens"] == 32
    assert summary["processed_prefill_tokens"] == 22  # saves 10
    assert summary["saving_ratio"] == pytest.approx(10 / 32)
    assert summary["saving_ratio_multi_level"] == pytest.approx(11 / 32)
    assert summary["saving_ratio_naive_first_level"] == pytest.approx(4 / 32)
    assert summary["groups"] == 3
    assert summary["seconds"] >= 0


def test_table_and_groups_file(tmp_path, capsys):
    path = _write(tmp_path / "in.jsonl", _fig4_lines())
    groups_path = tmp_path / "groups.jsonl"
    assert main(["analyze", path, "--groups", str(groups_path)]) == 0
    out = capsys.readouterr().out
    assert "optimal single-level groups" in out and "31.2%" in out
    groups = [json.loads(line) for line in groups_path.read_text().splitlines()]
    assert groups == [
        {"prefix_token_ids": [], "requests": [{"custom_id": "r0", "distinct_token_ids": [0, 5, 6]}]},
        {"prefix_token_ids": [1], "requests": [
            {"custom_id": "r1", "distinct_token_ids": [2, 3]},
            {"custom_id": "r2", "distinct_token_ids": [4, 5]},
            {"custom_id": "r5", "distinct_token_ids": [7, 7]}]},
        {"prefix_token_ids": [1] + [20] * 7, "requests": [
            {"custom_id": "r3", "distinct_token_ids": [3, 3]},
            {"custom_id": "r4", "distinct_token_ids": [4, 4]}]},
    ]


def test_bad_lines_are_reported_and_skipped(tmp_path, capsys):
    records = [
        {"custom_id": "a", "prompt_token_ids": [1, 2, 3]},
        {"custom_id": "a", "prompt_token_ids": [1, 2, 4]},  # duplicate custom_id
        {"custom_id": "b", "prompt_token_ids": []},  # empty prompt
        "{not json",
        {"custom_id": "c", "prompt_token_ids": [1, 2, 5]},
        {"custom_id": "d", "prompt_token_ids": [9]},  # single token: fine, shares nothing
    ]
    path = _write(tmp_path / "in.jsonl", records)
    assert main(["analyze", path, "--json"]) == 1
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["requests"] == 3 and summary["invalid_lines"] == 3
    assert summary["processed_prefill_tokens"] == 7 - 2
    assert "duplicate_custom_id" in captured.err and "empty" in captured.err and "line 4" in captured.err


def test_text_prompts_of_a_random_model_fail_clearly(tmp_path, capsys):
    path = _write(tmp_path / "in.jsonl", [{"custom_id": "a", "prompt": "hello world"}])
    assert main(["analyze", path, "--model", "random:tiny"]) == 2
    assert "line 1: random:tiny has no tokenizer" in capsys.readouterr().err


@pytest.mark.default_model
def test_chat_lines_use_the_default_model_of_run(capsys, cli_default_tokenizer):
    """No --model: the example's chat and text lines are tokenized with the model `batchllm run` loads."""
    from batchllm.models.default_model import default_model_path
    from model_helpers import EXAMPLE_INPUT, example_prompt_lengths

    tokenizer, sources = cli_default_tokenizer
    assert main(["analyze", EXAMPLE_INPUT, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert sources == [{"kind": "gguf", "path": str(default_model_path())}]
    lengths = example_prompt_lengths(tokenizer)
    assert summary["requests"] == len(lengths) == 10
    assert summary["logical_prefill_tokens"] == sum(lengths)
    assert summary["saved_prefill_tokens"] > 0  # the example's requests share documents


def test_missing_file(tmp_path, capsys):
    assert main(["analyze", str(tmp_path / "nope.jsonl")]) == 2
    assert "error" in capsys.readouterr().err


def test_empty_file(tmp_path, capsys):
    path = _write(tmp_path / "in.jsonl", [])
    assert main(["analyze", path, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["requests"] == 0 and summary["saving_ratio"] == 0.0


def test_token_id_analysis_never_imports_torch(tmp_path):
    path = _write(tmp_path / "in.jsonl", _fig4_lines())
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from batchllm.cli.main import main\n"
        f"sys.exit(main(['analyze', {path!r}, '--json']))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["processed_prefill_tokens"] == 22
