"""`batchllm bench` on CPU: a tiny random model, a tiny micro workload, two policies; --input files."""

import json

import pytest

from batchllm.perf.markdown import render_markdown
from batchllm.perf.policies import parse_policy
from batchllm.cli.main import main

MODEL = "random:tiny?vocab_size=32000"  # plain random:tiny (512 tokens) is too small for the generator
REQUIRED = {"workload", "requests", "model", "policy", "seconds", "req_per_s", "input_tok_per_s", "output_tok_per_s",
            "processed_prefill_tokens", "saving_ratio", "optimal_saving_ratio", "steps", "mean_tokens_per_step",
            "valley_steps", "peak_kv_blocks", "peak_kv_gib", "mean_step_ms", "schedule_ms_per_step",
            "launch_ms_per_step", "wait_ms_per_step", "flop_bound_s", "time_over_bound", "async_scheduling",
            "quantization", "kv_cache_dtype", "tensor_parallel_size", "flop_bound_peak_tflop_per_s",
            "kv_cache_tokens", "gpu_memory_utilization",
            "kv_bytes_per_token", "roofline_s", "time_over_roofline", "roofline_memory_bound_steps",
            "roofline_bandwidth_tb_per_s", "roofline_replay_matches_run", "attention_flop_share",
            "serial_roofline_s", "time_over_serial_roofline"}
BASE = ["bench", "--model", MODEL, "--device", "cpu", "--kv-cache-tokens", "4096", "--output-tokens", "3"]


def _table_rows(markdown: str) -> list[str]:
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    return lines[2:]  # header and separator


def test_micro_workload_two_policies(tmp_path, capsys):
    from batchllm.perf.runner import compiled_kernel_variants

    out, md = tmp_path / "e2e.json", tmp_path / "e2e.md"
    compiled_before = compiled_kernel_variants()  # this process's earlier tests may have compiled some
    code = main(BASE + ["--workload", "micro:48:8:4", "--requests", "12", "--policies", "batchllm,vllm+sync",
                        "--out", str(out), "--markdown", str(md), "--git-commit", "abc123"])
    assert code == 0
    result = json.loads(out.read_text())
    assert {"device", "date", "git_commit", "rows"} <= result.keys()
    assert result["device"] == "cpu" and result["git_commit"] == "abc123"
    assert result["compiled_kernel_variants"] == compiled_before  # CPU: no Triton kernel compiled
    rows = {row["policy"]: row for row in result["rows"]}
    assert list(rows) == ["batchllm", "vllm+sync"]
    for row in rows.values():
        assert REQUIRED <= row.keys(), REQUIRED - row.keys()
        assert row["workload"] == "micro:48:8:4" and row["requests"] == 12 and row["model"] == MODEL
        assert row["seconds"] > 0 and row["req_per_s"] > 0 and row["output_tok_per_s"] > 0
        assert 0 <= row["saving_ratio"] <= row["optimal_saving_ratio"] + 1e-9
        assert row["peak_kv_blocks"] > 0 and row["peak_kv_gib"] > 0
        assert row["time_over_bound"] > 0 and row["steps"] >= 3
        # the roofline charges the run's own steps at least their FLOPs: never below the FLOP bound
        assert row["roofline_replay_matches_run"] is True and row["roofline_s"] > 0
        assert 0 < row["time_over_roofline"] <= row["time_over_bound"]
        assert row["roofline_memory_bound_steps"] == row["steps"]  # a tiny model: every step is reads
        # each part at its own roofline, added: never below the plain roofline, never above the two
        # parts' FLOPs and bytes both paid in full
        assert row["serial_roofline_s"] >= row["roofline_s"]
        assert 0 < row["time_over_serial_roofline"] <= row["time_over_roofline"]
        # the default engine: no quantization, the KV cache in the model dtype (float32 on CPU), one device
        assert (row["quantization"], row["kv_cache_dtype"], row["tensor_parallel_size"]) == (None, "auto", 1)
        assert row["attention_backend"] == "torch"  # what `auto` resolves to on the CPU
        assert "allocator_retries" not in row  # the caching allocator's counters are CUDA's
        assert row["flop_bound_peak_tflop_per_s"] == 692.3
        assert 0 < row["attention_flop_share"] < 1
        assert row["kv_bytes_per_token"] == result["kv_bytes_per_token"]
    # 3 groups of 4 share 48 of 56 tokens: batchllm processes each prefix once, vllm (cold cache,
    # whole batch admitted together) recomputes more.
    assert rows["batchllm"]["optimal_saving_ratio"] == pytest.approx(3 * 48 / (4 * 56), abs=1e-3)
    assert rows["batchllm"]["saving_ratio"] == pytest.approx(rows["batchllm"]["optimal_saving_ratio"])
    assert rows["batchllm"]["saving_ratio"] >= rows["vllm+sync"]["saving_ratio"]
    assert rows["batchllm"]["processed_prefill_tokens"] == 12 * 56 - 9 * 48
    assert rows["batchllm"]["async_scheduling"] is True and rows["vllm+sync"]["async_scheduling"] is False
    table = md.read_text()
    assert len(_table_rows(table)) == len(result["rows"]) == 2
    assert "quantization / KV cache" not in table  # only default engines: no engine column
    assert "| time / bound | roofline s | time / roofline | serial roofline s | time / serial roofline |" in table and "4.2 TB/s (H200 copy ceiling)" in table
    assert table in capsys.readouterr().out  # also printed


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_input_file_with_bad_lines(tmp_path, capsys):
    prefix = list(range(1000, 1040))
    records = [
        {"custom_id": "a", "prompt_token_ids": prefix + [5, 6], "max_tokens": 2},
        "{not json",
        {"custom_id": "b", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": prefix + [7, 8, 9], "max_tokens": 4}},
        {"custom_id": "c", "prompt": "text needs a tokenizer", "max_tokens": 4},  # random: has none
        {"custom_id": "d", "prompt_token_ids": prefix + [10]},  # no max_tokens: 16 (completions default)
        {"custom_id": "e", "prompt_token_ids": [1, 2, 99999]},  # outside the vocabulary
    ]
    path = _write(tmp_path / "mine.jsonl", records)
    out = tmp_path / "r.json"
    assert main(BASE + ["--input", path, "--policies", "batchllm,vllm", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    result = json.loads(out.read_text())
    assert [row["policy"] for row in result["rows"]] == ["batchllm", "vllm"]  # no generated workload
    for row in result["rows"]:
        assert row["workload"] == "mine.jsonl" and row["requests"] == 3 and row["skipped_lines"] == 3
        assert row["output_tok_per_s"] / row["req_per_s"] == pytest.approx((2 + 4 + 16) / 3, rel=0.01)
    assert result["inputs"] == [{"file": path, "workload": "mine.jsonl", "requests": 3, "skipped_lines": 3}]
    assert "line 2: skipped (invalid_json" in captured.out
    assert "line 4: skipped" in captured.out and "prompt_token_ids" in captured.out
    assert "line 6: skipped" in captured.out
    assert "3 lines skipped" in captured.out
    assert result["rows"][0]["saving_ratio"] >= result["rows"][1]["saving_ratio"]
    markdown = (tmp_path / "r.md").read_text()  # default: --out with .md
    assert len(_table_rows(markdown)) == 2 and "3 lines skipped" in markdown


def test_input_with_no_runnable_line(tmp_path, capsys):
    path = _write(tmp_path / "text.jsonl", [{"custom_id": "a", "prompt": "hi", "max_tokens": 2}])
    assert main(BASE + ["--input", path, "--policies", "batchllm", "--out", str(tmp_path / "r.json")]) == 2
    assert "needs prompt_token_ids" in capsys.readouterr().out


def test_help_and_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--input" in out and "--markdown" in out and "examples:" in out
    assert main(BASE + ["--policies", "nope"]) == 2
    assert "unknown policy" in capsys.readouterr().err
    assert main(BASE + ["--input", str(tmp_path / "missing.jsonl")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["bench", "--model", "random:tiny", "--device", "cpu", "--kv-cache-tokens", "1024",
                 "--requests", "4", "--output-tokens", "2", "--out", str(tmp_path / "r.json")]) == 2
    assert "too small for generated workloads" in capsys.readouterr().err


def test_default_model_needs_cuda(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert "no CUDA" in err and "--model" in err
    assert not (tmp_path / "r.json").exists()


def test_policy_labels():
    spec = parse_policy("vllm@1024/16384+eager+sync")
    assert spec.name == "vllm" and spec.flags == {"eager", "sync"}
    assert spec.changes == {"policy": "vllm", "max_num_seqs": 1024, "max_num_batched_tokens": 16384}
    spec = parse_policy("batchllm@8192")
    assert (spec.label, spec.name, spec.changes, spec.flags) == ("batchllm@8192", "batchllm",
                                             {"policy": "batchllm", "max_num_batched_tokens": 8192}, frozenset())


def test_markdown_failed_and_peer_rows():
    result = {"model": "m", "device": "d", "date": "x", "git_commit": None, "kv_bytes_per_token": 2, "rows": [
        {"workload": "w", "policy": "vllm", "error": "RuntimeError('boom|x')"},
        {"workload": "w", "requests": 4, "model": "m", "policy": "hf-generate (static batch 2, sdpa; scaled)",
         "seconds": 2.0, "req_per_s": 2.0, "output_tok_per_s": 10.0, "time_over_bound": 3.0},
    ]}
    text = render_markdown(result)
    rows = _table_rows(text)
    assert len(rows) == 2 and "failed" in rows[0] and "hf-generate" in rows[1]
    assert all(row.count(" | ") == rows[0].count(" | ") for row in rows)
    assert "boom" in text


def test_writes_nothing_unless_told(tmp_path, capsys, monkeypatch):
    """Without --out / --markdown the table is printed and no file is written (a run in a checkout
    must not touch tracked files); '+eager' runs the policy without CUDA graphs."""
    monkeypatch.chdir(tmp_path)
    assert main(BASE[:-2] + ["--output-tokens", "2", "--workload", "micro:32:8:2#4", "--policies",
                             "batchllm+eager"]) == 0
    out = capsys.readouterr().out
    assert "batchllm+eager" in out and "wrote" not in out
    assert list(tmp_path.iterdir()) == []


def test_compiled_kernel_variants_counts_triton_caches(monkeypatch):
    """The bench records how many variants of each kernel were compiled (more than one per dtype /
    tile config means mid-run recompiles); counted from Triton's per-device kernel caches."""
    from batchllm.perf.runner import compiled_kernel_variants
    from batchllm.ops import attention_kernels, kv_store

    class FakeJit:
        def __init__(self, per_device):
            self.device_caches = {dev: (dict.fromkeys(range(n)), "target") for dev, n in per_device.items()}

        def run(self):
            pass

    monkeypatch.setattr(attention_kernels, "work_list_attention_kernel", FakeJit({0: 1, 1: 2}), raising=True)
    monkeypatch.setattr(kv_store, "fake_store_kernel", FakeJit({0: 0}), raising=False)
    counts = compiled_kernel_variants()  # other kernels count too where earlier tests compiled them (GPU)
    assert counts["work_list_attention_kernel"] == 3 and "fake_store_kernel" not in counts


def test_fp8_variants_need_a_recent_gpu(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for flags in (["--quantization", "fp8"], ["--kv-cache-dtype", "fp8"], ["--quantization", "none,fp8"]):
        assert main(BASE + flags + ["--out", str(tmp_path / "r.json")]) == 2
        err = capsys.readouterr().err
        assert "compute capability 8.9" in err and "(Ada, Hopper)" in err and "fix:" in err
    assert main(BASE + ["--quantization", "int4"]) == 2
    assert "unknown value 'int4' in --quantization" in capsys.readouterr().err
    assert main(BASE + ["--kv-cache-dtype", ","]) == 2
    assert "--kv-cache-dtype is empty" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_help_names_the_fp8_options(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--quantization {none,fp8}" in out and "--kv-cache-dtype {auto,fp8}" in out
    assert "compute capability 8.9+ (Ada or Hopper)" in out and "--quantization none,fp8" in out


def test_model_that_cannot_load(tmp_path, capsys):
    assert main(["bench", "--model", "random:no-such-preset", "--device", "cpu", "--out", str(tmp_path / "r.json")]) == 2
    error_lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and "cannot load the model random:no-such-preset" in error_lines[0]
    assert "fix:" in error_lines[0] and not (tmp_path / "r.json").exists()


def test_hf_peer_sweep(tmp_path, capsys):
    """--hf-peer B,B: HF generate timed at each batch size after the engine rows, the fastest
    reported with every size under "sweep"; the table notes the sweep."""
    out = tmp_path / "r.json"
    assert main(BASE + ["--workload", "micro:32:8:2#6", "--policies", "batchllm", "--hf-peer", "2,4",
                        "--hf-peer-requests", "4", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["policy"].split(" ")[0] for row in rows] == ["batchllm", "hf-generate"]
    peer = rows[-1]
    assert [(entry["batch_size"], entry["requests"]) for entry in peer["sweep"]] == [(2, 4), (4, 4)]
    best = max(peer["sweep"], key=lambda entry: entry["req_per_s"])
    assert peer["batch_size"] == best["batch_size"] and peer["measured_requests"] == 4 and peer["requests"] == 6
    assert peer["policy"] == f"hf-generate (static batch {best['batch_size']}, sdpa; scaled)"
    assert peer["roofline_s"] > 0 and peer["time_over_roofline"] > 0
    assert (peer["quantization"], peer["kv_cache_dtype"], peer["tensor_parallel_size"]) == (None, "auto", 1)
    markdown = (tmp_path / "r.md").read_text()
    assert len(_table_rows(markdown)) == 2 and "batch 2: " in markdown and "(reported)" in markdown
    for bad in (["--hf-peer", "64,x"], ["--hf-peer", "0,64"], ["--hf-peer", "8", "--hf-peer-requests", "0"]):
        assert main(BASE + bad) == 2
        assert "--hf-peer" in capsys.readouterr().err
