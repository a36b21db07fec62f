"""`batchllm plot`: its help names where traces come from, with an example; without matplotlib
it says what to install instead of failing on an import."""

import importlib.util
import json

import pytest

from batchllm.cli.main import main


def test_help_names_the_trace_sources_and_an_example(capsys):
    with pytest.raises(SystemExit):
        main(["plot", "--help"])
    out = capsys.readouterr().out
    assert "`batchllm simulate --trace OUT.json` or\n`batchllm bench --trace-dir DIR`" in out
    assert "  batchllm simulate examples/batch.jsonl --trace steps.json\n  batchllm plot steps.json -o steps.png" in out


def test_without_matplotlib_it_names_the_install(tmp_path, capsys, monkeypatch):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"custom_id": "a", "prompt_token_ids": [1, 2, 3], "max_tokens": 2}) + "\n")
    trace = tmp_path / "steps.json"
    assert main(["simulate", str(source), "--trace", str(trace), "--json"]) == 0
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "matplotlib"
                        else find_spec(name, *args))
    assert main(["plot", str(trace), "-o", str(tmp_path / "steps.png")]) == 2
    assert capsys.readouterr().err == ("batchllm plot: error: it draws with matplotlib, which is not installed "
                                       "(fix: pip install matplotlib)\n")
    assert not (tmp_path / "steps.png").exists()
