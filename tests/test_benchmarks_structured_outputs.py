"""benchmarks/structured_outputs.py runs end to end on a tiny model: the constrained batch
generates exactly the tokens of the unconstrained one (no answer completes the benchmark's
schema), and the matcher mode reports its host cost per row."""

from script_loader import load_benchmark_script

structured_outputs = load_benchmark_script("structured_outputs.py")


def test_engine_mode_runs_both_batches_to_the_same_length(tmp_path):
    out = tmp_path / "structured.json"
    result = structured_outputs.main([
        "engine", "--model", "random:tiny?vocab_size=32000", "--device", "cpu", "--dtype", "float32", "--kv-cache-tokens", "4096",
        "--workload", "micro:32:8:4", "--requests", "8", "--output-tokens", "6", "--repeats", "1",
        "--out", str(out)])
    free, held = result["unconstrained_0"], result["json_schema_0"]
    assert free["output_tokens"] == held["output_tokens"] == 8 * 6
    assert free["finish_reasons"] == held["finish_reasons"] == {"length": 8}
    assert result["vocabulary"] == "synthetic" and result["vocab_size"] == 32000 and result["ratio"] > 0
    assert out.read_text().startswith("{")


def test_matcher_mode_reports_microseconds_per_row():
    result = structured_outputs.main(["matcher", "--vocab-size", "700", "--rows", "4", "--steps", "3"])
    assert (result["rows"], result["steps"], result["vocab_size"]) == (4, 3, 700)
    assert result["fill_us_per_row"] > 0 and result["accept_us_per_row"] > 0
