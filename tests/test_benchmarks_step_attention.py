"""benchmarks/step_attention.py on CPU (the Triton interpreter): its dry run checks every row's
output against the reference row on the converted cache and writes one row per kind."""

import json

from tests.script_loader import load_benchmark_script

step_attention = load_benchmark_script("step_attention.py")


def test_dry_run_writes_the_decode_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "decode.json"
    assert step_attention.main(["--dry-run", "--steps", "decode", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    kinds = [("bf16_row", "float32"), ("fp8_row", "float8_e4m3fn")]
    assert [(r["row"], r["cache_dtype"]) for r in rows] == kinds * 2
    assert [r.get("groups") for r in rows] == [None, None, 2, 2]
    assert all(r["ms_per_layer"] > 0 for r in rows)
    # K and V of every position's 8 KV heads x 128 dims: 4 bytes a value in float32, 1 in FP8
    torch = step_attention.torch
    positions = int(step_attention.decode_step(6, 40, torch.float32, torch.device("cpu")).seq_lens.sum())
    assert rows[0]["cache_bytes"] == positions * 8 * 128 * 2 * 4
    assert rows[1]["cache_bytes"] == positions * 8 * 128 * 2
    # a group's 40-position prefix counted once, beside each of its 3 members' own positions
    shared = step_attention.shared_decode_step(2, 3, 40, 4, 12, torch.float32, torch.device("cpu"))
    own = int((shared.seq_lens - shared.shared_kv_lens).sum())
    assert 6 * 4 <= own < 6 * 12 and rows[3]["cache_bytes"] == (2 * 40 + own) * 8 * 128 * 2
    # each launch of the shared step alone, on the bytes it reads: the prefixes, the own positions
    for row, bytes_per_value in ((rows[2], 4), (rows[3], 1)):
        assert row["big_launch_ms"] > 0 and row["small_launch_ms"] > 0
        assert row["big_launch_bytes"] == 2 * 40 * 8 * 128 * 2 * bytes_per_value
        assert row["small_launch_bytes"] == own * 8 * 128 * 2 * bytes_per_value
        for launch in ("big", "small"):
            assert row[f"{launch}_launch_tb_per_s"] == round(row[f"{launch}_launch_bytes"] / row[f"{launch}_launch_ms"] / 1e9, 2)
    assert not any("big_launch_ms" in row for row in rows[:2])  # plain decode has no BIG items


def test_dry_run_writes_the_prefill_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "prefill.json"
    assert step_attention.main(["--dry-run", "--steps", "prefill", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    kinds = [("fused", "float32", False), ("prefill_table", "float32", True), ("fused", "float8_e4m3fn", False),
             ("prefill_table", "float8_e4m3fn", True)]
    assert [(r["shape"], r["row"], r["cache_dtype"], r["split_classes"]) for r in rows] == [
        (shape, *kind) for shape in ("128/128", "2048/128", "shared prefixes") for kind in kinds]
    assert [r["fp8_conversion"] for r in rows[:4]] == [None, None, "query", "float16_ptx_v"]
    assert all(r["ms_per_layer"] > 0 for r in rows)


def test_decode_step_draws_contexts_around_the_mean():
    batch = step_attention.decode_step(50, 100, step_attention.torch.float32, step_attention.torch.device("cpu"))
    lengths = batch.seq_lens.tolist()
    assert len(lengths) == 50 and min(lengths) >= 80 and max(lengths) <= 120


def test_prefill_steps_hold_their_decode_rows_and_prompts():
    steps = step_attention.prefill_steps(dry_run=False)
    uniform = steps["128/128"]
    assert sum(s.q_len == 1 for s in uniform) == 7100 and all(128 < s.seq_len < 256 for s in uniform if s.q_len == 1)
    assert [s.q_len for s in uniform if s.q_len > 1] == [128] * 34
    shared = steps["shared prefixes"]
    assert sum(s.group_id >= 0 and not s.is_prefix for s in shared) == 640 and shared[-1].q_len == 2048


def test_dry_run_between_gemms_times_each_row_inside_its_steps_linear_layers(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "decode.json"
    assert step_attention.main(["--dry-run", "--steps", "decode", "--between-gemms", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["row"] for r in rows] == ["bf16_row", "fp8_row"] * 2
    assert all(r["layer_ms"] > 0 and r["gemms_ms"] > 0 for r in rows)
    # one step's linear layers, timed once per step: its rows share the figure
    assert rows[0]["gemms_ms"] == rows[1]["gemms_ms"] and rows[2]["gemms_ms"] == rows[3]["gemms_ms"]


def test_step_gemms_runs_one_layers_four_linear_layers_at_the_steps_rows():
    torch = step_attention.torch
    outputs = step_attention.step_gemms(5, torch.device("cpu"), dry_run=True)()
    assert [tuple(o.shape) for o in outputs] == [(5, 96), (5, 64), (5, 128), (5, 64)]
