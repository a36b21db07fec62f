"""benchmarks/penalties.py runs end to end on a tiny model: the penalised batch generates exactly
the tokens of the plain one (EOS ignored)."""

from script_loader import load_benchmark_script

penalties = load_benchmark_script("penalties.py")


def test_engine_mode_runs_both_batches_to_the_same_length(tmp_path):
    out = tmp_path / "penalties.json"
    result = penalties.main([
        "engine", "--model", "random:tiny?vocab_size=32000", "--device", "cpu", "--dtype", "float32",
        "--kv-cache-tokens", "4096",
        "--workload", "micro:32:8:4", "--requests", "8", "--output-tokens", "6", "--repeats", "1",
        "--out", str(out)])
    none, every_row = result["none_0"], result["every_row_0"]
    assert none["output_tokens"] == every_row["output_tokens"] == 8 * 6 and none["steps"] == every_row["steps"]
    assert result["ratio"] > 0 and out.read_text().startswith("{")
