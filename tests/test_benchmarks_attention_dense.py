"""The dense scenarios of benchmarks/attention.py: shapes, FLOP counts, the float32 reference
and the SDPA wrapper, on CPU (the Triton interpreter for our kernel)."""

import json
import time

import pytest
import torch

from tests.script_loader import load_benchmark_script

attention = load_benchmark_script("attention.py")


def test_causal_pairs_counts_bottom_right_aligned_rows():
    assert attention.causal_pairs(4, 4) == 1 + 2 + 3 + 4
    assert attention.causal_pairs(2, 5) == 4 + 5  # rows see 4 and 5 keys
    assert attention.causal_pairs(2048, 2048) == 2048 * 2049 // 2


def _naive_attention(q, k, v, scale):
    """Per row, per head, one softmax in float64: [B, H, Lq, D] -> [B * Lq, H, D]."""
    batch, heads, q_len, _ = q.shape
    context = k.shape[2]
    out = torch.empty(batch, q_len, heads, q.shape[3], dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for i in range(q_len):
                keys = context - q_len + i + 1
                weights = torch.softmax(k[b, h, :keys].double() @ q[b, h, i].double() * scale, dim=0)
                out[b, i, h] = weights @ v[b, h, :keys].double()
    return out.reshape(-1, heads, q.shape[3])


@pytest.mark.parametrize("q_len, context", [(5, 5), (3, 7)])
def test_dense_reference_and_sdpa_wrapper_equal_a_naive_softmax(q_len, context):
    generator = torch.Generator().manual_seed(q_len)
    q, k, v = (torch.randn(2, 4, n, 8, generator=generator) for n in (q_len, context, context))
    expected = _naive_attention(q, k, v, 0.3).float()
    chunked = attention.dense_reference(q, k, v, 0.3, rows_per_chunk=2)
    torch.testing.assert_close(chunked, expected, rtol=1e-5, atol=1e-5)
    sdpa = attention._sdpa_backend_fn("MATH", q, k, v, 0.3)()
    torch.testing.assert_close(sdpa, expected, rtol=1e-5, atol=1e-5)


def test_dense_dry_run_validates_our_kernel_on_every_shape(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out, markdown = tmp_path / "attention.json", tmp_path / "attention.md"
    attention.main(["--dry-run", "--scenarios", "dense", "--out", str(out), "--markdown", str(markdown)])
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {r["config"] for r in rows} <= set(result["tile_configs"])
    shapes = [(r["batch"], r["q_len"], r["context"], r["shared"]) for r in rows]
    assert shapes == attention.DRY_DENSE_SHAPES
    assert all(r["impl"] == "batchllm" and r["valid"] and r["max_abs_err"] < 1e-4 for r in rows)
    for r in rows:
        flops = 4.0 * attention.NUM_HEADS * attention.HEAD_DIM * attention.causal_pairs(r["q_len"], r["context"]) * r["batch"]
        assert r["tflop_per_s"] == round(flops / r["us"] / 1e6, 1)
    table = markdown.read_text()
    assert "| last 16 rows of 48, 32 shared |" in table and "prefix/distinct/group" not in table


@pytest.mark.parametrize("q_len, context", [(5, 5), (3, 7)])
def test_sdpa_peer_settings_agree(q_len, context):
    """The SDPA peer's swept settings (KV heads repeated, and the KV heads as they are with
    grouped-query attention in the kernel, head-major and token-major) compute the same
    attention: the second reads every query-head group's own KV head back out of the repeated
    K / V."""
    generator = torch.Generator().manual_seed(context)
    rep = attention.NUM_HEADS // attention.NUM_KV_HEADS
    q = torch.randn(1, attention.NUM_HEADS, q_len, 8, generator=generator)
    k, v = (torch.randn(1, attention.NUM_KV_HEADS, context, 8, generator=generator).repeat_interleave(rep, dim=1)
            for _ in range(2))
    expected = attention.dense_reference(q, k, v, 0.3)
    variants = attention.sdpa_variants("MATH", q, k, v, 0.3)
    # the direct cuDNN op is for the cuDNN peer only
    assert [tag for tag, _ in variants] == ["", "gqa", "bshd", "bshd_gqa"]
    for _, fn in variants:
        torch.testing.assert_close(fn(), expected, rtol=1e-5, atol=1e-5)


def test_token_major_keeps_values_and_stores_tokens_outermost():
    t = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).view(2, 3, 4, 5)
    moved = attention.token_major(t)
    assert torch.equal(moved, t) and moved.transpose(1, 2).is_contiguous() and not moved.is_contiguous()


def test_best_variant_is_the_fastest_valid_one():
    """A variant whose output misses the reference is never chosen over a valid one, however fast."""
    ref = torch.zeros(4, 2, 8)
    impls = {"peer": [("wrong", lambda: ref + 1.0), ("right", lambda: (time.sleep(0.02), ref.clone())[1])]}
    notes = []
    us, err, tag = attention._time_impls(impls, ref, notes, "test")["peer"]
    assert (tag, err) == ("right", 0.0) and not notes
    only_wrong = attention._time_impls({"peer": impls["peer"][:1]}, ref, notes, "test")["peer"]
    assert only_wrong[2] == "wrong" and only_wrong[1] == 1.0  # reported, and marked invalid by its row


def _shared_row(impl, us, **extra):
    return {"scenario": "decode", "prefix": 64, "distinct": 8, "group": 4, "impl": impl, "us": us, "valid": True,
            "speedup_vs_plain": round(400.0 / us, 3), "kv_tb_per_s": 1.5, "prefix_tflop_per_s": 20.0, **extra}


def test_shared_table_has_flashinfer_columns_only_with_flashinfer_rows():
    rows = [_shared_row("fused", 100.0), _shared_row("fused_auto", 80.0), _shared_row("plain", 400.0)]
    table = attention.markdown_table({"rows": rows}).splitlines()
    assert "flashinfer" not in table[0] and table[1] == "|" + "---|" * 13
    assert table[2] == "| 64/8/4 | decode | 100.0 | - | 80.0 | 400.0 | - | - | 4.00x | - | 5.00x | 1.50 | 20.0 |"
    with_peer = attention.markdown_table({"rows": rows + [_shared_row("flashinfer", 250.0)]}).splitlines()
    assert "flashinfer us" in with_peer[0] and "fused vs flashinfer" in with_peer[0]
    assert with_peer[2].endswith("| 4.00x | - | 5.00x | 2.50x | 1.50 | 20.0 |")
