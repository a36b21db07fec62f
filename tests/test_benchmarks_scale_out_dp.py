"""benchmarks/scale_out_dp.py on the CPU: a tiny model on one device, then on 2 Ray replicas of a
local cluster; the rows carry the measurement and the Ray tokens equal the one-device tokens. The
speedup itself means something on GPUs only."""

import json

from script_loader import load_benchmark_script

pytest_plugins = ["ray_fixtures"]  # ray_address: skips where Ray is not installed

MODEL = "random:tiny?vocab_size=32000"  # generated workloads draw token ids from 1000 up
NUM_REQUESTS, OUTPUT_NUM_TOKENS = 16, 4
ROW_FIELDS = {"what", "model", "workload", "replicas", "gpus", "requests", "seconds", "requests_per_s",
              "output_tokens_per_s", "saving_ratio", "balance", "outputs_equal", "token_match", "speedup",
              "kv_cache_tokens"}


def _script():
    return load_benchmark_script("scale_out_dp.py")


def test_one_device_and_ray_rows(ray_address, tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    argv = ["--model", MODEL, "--workload", f"micro:64:8:4#{NUM_REQUESTS}", "--output-tokens", str(OUTPUT_NUM_TOKENS),
            "--replicas", "2", "--kv-cache-tokens", "1024", "--check-shards", "--out", str(out)]
    assert _script().main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == rows
    one, ray = rows
    for row in rows:
        assert ROW_FIELDS <= row.keys()
        assert row["what"] == "dp_throughput" and row["workload"] == "micro:64:8:4" and row["model"] == MODEL
        assert row["requests"] == NUM_REQUESTS and row["errors"] == 0
        assert row["output_tokens"] == NUM_REQUESTS * OUTPUT_NUM_TOKENS
        assert row["saving_ratio"] > 0 and row["balance"] >= 1.0
        assert row["gpus"] == 0 and row["kv_cache_tokens"] == 1024
    assert (one["replicas"], ray["replicas"]) == (1, 2)
    assert one["balance"] == 1.0 and one["speedup"] is None and one["outputs_equal"] is None
    assert ray["outputs_equal"] is True and ray["token_match"] == 1.0
    assert one["shards_alone_token_match"] == 1.0 and ray["equal_to_shards_alone_on_one_device"] is True
    assert ray["speedup"] > 0
    assert ray["replica_kv_cache_tokens"] == [1024, 1024]
    assert len(ray["replica_finish_seconds"]) == 2 and ray["measured_balance"] >= 1.0


def test_refuses_more_replicas_than_gpus(monkeypatch, capsys):
    script = _script()
    monkeypatch.setattr(script, "visible_gpu_count", lambda: 1)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert script.main(["--model", MODEL, "--replicas", "2"]) == 2
    assert "--replicas 2 needs 2 GPUs (one per replica), this host shows 1" in capsys.readouterr().err
