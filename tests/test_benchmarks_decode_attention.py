"""benchmarks/decode_attention.py on CPU (the Triton interpreter): its dry run checks the FP8 row
against the bf16 row on the converted cache and writes one row per decode row kind."""

import json

from tests.script_loader import load_benchmark_script

decode_attention = load_benchmark_script("decode_attention.py")


def test_dry_run_writes_both_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "decode.json"
    assert decode_attention.main(["--dry-run", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["row"], r["cache_dtype"]) for r in rows] == [("bf16_row", "float32"), ("fp8_row", "float8_e4m3fn")]
    assert all(r["ms_per_layer"] > 0 for r in rows)
    # K and V of every position's 8 KV heads x 128 dims: 4 bytes a value in float32, 1 in FP8
    torch = decode_attention.torch
    positions = int(decode_attention.decode_step(6, 40, torch.float32, torch.device("cpu")).seq_lens.sum())
    assert rows[0]["cache_bytes"] == positions * 8 * 128 * 2 * 4
    assert rows[1]["cache_bytes"] == positions * 8 * 128 * 2


def test_decode_step_draws_contexts_around_the_mean():
    batch = decode_attention.decode_step(50, 100, decode_attention.torch.float32, decode_attention.torch.device("cpu"))
    lengths = batch.seq_lens.tolist()
    assert len(lengths) == 50 and min(lengths) >= 80 and max(lengths) <= 120
