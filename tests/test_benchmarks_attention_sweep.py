"""benchmarks/attention.py --scenarios decode_sweep on CPU (--dry-run: tiny steps in the Triton
interpreter): one validated row per step, cache and candidate decode tile, and the table."""

import json

from tests.script_loader import load_benchmark_script

attention = load_benchmark_script("attention.py")


def test_decode_sweep_dry_run_times_every_candidate_on_both_caches(tmp_path, monkeypatch, capsys):
    from batchllm.attention_plan.tile_config import decode_tile_candidates

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "sweep.json"
    attention.main(["--dry-run", "--scenarios", "decode_sweep", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    group = attention.NUM_HEADS // attention.NUM_KV_HEADS
    names = {cache: list(decode_tile_candidates(attention.HEAD_DIM, group, kv_fp8)) for cache, kv_fp8 in
             (("float8_e4m3fn", True), ("float32", False))}
    shapes = ["3x40", "40/20/all"]
    assert [(r["shape"], r["cache"], r["config"]) for r in rows] == [
        (shape, cache, name) for shape in shapes for cache in names for name in names[cache]]
    assert all(r["valid"] and r["max_abs_err"] < 2e-3 for r in rows)
    # 3 requests x 40 positions x 2 KV heads x 32 dims, K and V, 1 byte a value
    assert rows[0]["kv_tb_per_s"] == round(3 * 40 * 2 * 32 * 2 / rows[0]["us"] / 1e6, 3)
    printed = capsys.readouterr().out.strip().splitlines()
    table = [line for line in printed if line.startswith("|")]
    assert printed[-len(table):] == table  # the table last, after one line a row
    assert printed[0] == f"3x40 float8_e4m3fn bf16_row: {rows[0]['us']:.0f} us, max abs err {rows[0]['max_abs_err']:.2g}"
    assert table[0] == "| cache config | 3x40 | 40/20/all | geo-mean |"
    assert len(table) == 2 + sum(len(n) for n in names.values()) and table[2].startswith("| float8_e4m3fn bf16_row |")
