"""--out and --markdown are rewritten after every row: a run that dies later keeps what it measured."""

import json

import pytest

from batchllm.perf import runner
from batchllm.perf.engine_variants import EngineVariant
from batchllm.perf.result_files import ResultFiles
from batchllm.perf.runner import BenchOptions, load_llm, run_variants
from batchllm.cli.main import main

MODEL = "random:tiny?vocab_size=32000"


def test_write_replaces_both_files(tmp_path):
    files = ResultFiles(str(tmp_path / "sub" / "r.json"), str(tmp_path / "r.md"))
    assert files.paths == [str(tmp_path / "sub" / "r.json"), str(tmp_path / "r.md")]
    for num_rows in (1, 2):
        rows = [{"workload": "w", "policy": f"p{i}", "seconds": 1.0} for i in range(num_rows)]
        files.write({"model": "m", "rows": rows})
        assert json.loads((tmp_path / "sub" / "r.json").read_text())["rows"] == rows
        assert (tmp_path / "r.md").read_text().count("| w | p") == num_rows
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["r.json", "r.md", "sub"]  # no partial file left
    assert ResultFiles().paths == []
    ResultFiles().write({"rows": []})  # nothing asked for, nothing written


def test_rows_of_a_run_that_raises_later_are_on_disk(tmp_path):
    """The second engine variant fails in a way the bench does not catch: the first's rows are written."""
    files = ResultFiles(str(tmp_path / "r.json"), str(tmp_path / "r.md"))

    def load(options, variant):
        if variant.quantization == "fp8":
            raise RuntimeError("CUDA out of memory (stand-in)")
        return load_llm(options, variant)

    options = BenchOptions(model=MODEL, workloads=["micro:32:8:2#4"], output_tokens=2, policies="batchllm,vllm",
                           kv_cache_tokens=4096, device="cpu", git_commit="abc",
                           variants=(EngineVariant(), EngineVariant("fp8")))
    with pytest.raises(RuntimeError, match="out of memory"):
        run_variants(options, load=load, log=lambda text: None, on_update=files.write)
    written = json.loads((tmp_path / "r.json").read_text())
    assert [row["policy"] for row in written["rows"]] == ["batchllm", "vllm"]
    assert {"device", "date", "git_commit", "model", "kv_bytes_per_token", "compiled_kernel_variants"} <= written.keys()
    assert "| micro:32:8:2 | vllm |" in (tmp_path / "r.md").read_text()


def test_the_command_keeps_the_first_row_when_interrupted(tmp_path, monkeypatch):
    real_run_policy = runner.run_policy
    calls = []

    def run_policy(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # not a policy failure: ends the run (exit code 130)
        return real_run_policy(*args, **kwargs)

    monkeypatch.setattr(runner, "run_policy", run_policy)
    out = tmp_path / "r.json"
    assert main(["bench", "--model", MODEL, "--device", "cpu", "--kv-cache-tokens", "4096", "--output-tokens", "2",
                 "--workload", "micro:32:8:2#4", "--policies", "batchllm,vllm", "--out", str(out)]) == 130
    assert [row["policy"] for row in json.loads(out.read_text())["rows"]] == ["batchllm"]
    assert "| micro:32:8:2 | batchllm |" in (tmp_path / "r.md").read_text()


def test_git_commit_names_a_tree_that_differs_from_its_commit_dirty(tmp_path, monkeypatch):
    """A row's commit is the checkout's short hash, with "-dirty" when tracked files were changed
    (a run on a copied tree must not name a commit its code was not); untracked files do not
    count, and outside git there is none."""
    import subprocess

    monkeypatch.delenv(runner.GIT_COMMIT_ENV, raising=False)

    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              capture_output=True, text=True, check=True).stdout.strip()

    assert runner.git_commit(str(tmp_path)) is None
    git("init", "-q")
    assert runner.git_commit(str(tmp_path)) is None  # no commit yet
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-q", "-m", "one")
    head = git("rev-parse", "--short", "HEAD")
    assert runner.git_commit(str(tmp_path)) == head
    (tmp_path / "notes.txt").write_text("untracked\n")
    assert runner.git_commit(str(tmp_path)) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert runner.git_commit(str(tmp_path)) == head + "-dirty"


def test_git_commit_takes_the_commit_the_environment_names(tmp_path, monkeypatch):
    """A copied tree whose git metadata is stale names its commit through the environment, in
    every benchmark that records one; a blank value is no name."""
    monkeypatch.setenv(runner.GIT_COMMIT_ENV, "abc1234")
    assert runner.git_commit(str(tmp_path)) == "abc1234"
    monkeypatch.setenv(runner.GIT_COMMIT_ENV, " ")
    assert runner.git_commit(str(tmp_path)) is None  # tmp_path is not a checkout


def test_report_result_prints_the_json_and_writes_it_only_when_asked(tmp_path, capsys):
    from batchllm.perf.result_files import report_result

    result = {"ratio": 0.999, "runs": [1, 2]}
    out = tmp_path / "sub" / "r.json"
    report_result(result, str(out))
    assert json.loads(capsys.readouterr().out) == result
    assert json.loads(out.read_text()) == result and out.read_text().endswith("\n")
    report_result(result, None)
    assert json.loads(capsys.readouterr().out) == result
    assert sorted(p.name for p in out.parent.iterdir()) == ["r.json"]  # no partial file left
