"""benchmarks/bounds.py: the bounds of a replayed schedule in order, the batchllm policy's FLOP
bound the optimal one, and the serial roofline at a GEMM rate below the peak above it."""

import json

import pytest
from script_loader import load_benchmark_script

from batchllm.perf.flop_bound import H200_BF16_PEAK_FLOPS, work_flops
from batchllm.perf.workload import make_workload
from batchllm.models.presets import PRESETS
from batchllm.prefix.planner import plan_prefix_groups


def test_bounds_of_a_small_workload(tmp_path, capsys):
    script = load_benchmark_script("bounds.py")
    out = tmp_path / "bounds.json"
    assert script.main(["--workload", "micro:64:16:4#16", "--policies", "batchllm,vllm", "--output-tokens", "5",
                        "--kv-cache-tokens", "4096", "--max-num-batched-tokens", "256", "--out", str(out)]) == 0
    rows = {row["policy"]: row for row in json.loads(out.read_text())["rows"]}
    assert len(capsys.readouterr().out.splitlines()) == 2
    arch = PRESETS["llama-3.1-8b"]
    workload = make_workload("micro:64:16:4", 16, 5, arch.vocab_size, 0)
    plan = plan_prefix_groups([p.tolist() for p in workload.prompts])
    groups = [(len(g.prefix_token_ids), [len(d) for d in g.distinct_token_ids], g.request_indices) for g in plan.groups]
    optimal_s = work_flops(arch, groups, workload.max_tokens) / H200_BF16_PEAK_FLOPS
    batchllm = rows["batchllm"]
    assert batchllm["flop_bound_s"] == pytest.approx(optimal_s, abs=1e-3)
    for row in rows.values():
        # 16 requests of 80 tokens: every step reads all 16 GB of weights, so reads bound each step
        assert row["flop_bound_s"] < row["roofline_s"] <= row["serial_roofline_s"] < row["serial_at_gemm_rate_s"] + 1e-9
        assert 0 < row["attention_roofline_s"] < row["serial_roofline_s"]
        assert row["serial_roofline_over_flop_bound"] == pytest.approx(row["serial_roofline_s"] / optimal_s, abs=2e-3)
    assert rows["vllm"]["roofline_s"] >= batchllm["roofline_s"]  # it reads every prefix once per request


def test_gemm_rate_must_be_positive():
    with pytest.raises(SystemExit):
        load_benchmark_script("bounds.py").main(["--gemm-tflops", "0"])


def test_fp8_bounds_and_attention_at_its_own_rate():
    """FP8: the same schedule's FLOPs at the FP8 peak, and half the weight and KV bytes; attention at a
    rate below the peak raises only the serial roofline's attention part."""
    from batchllm.perf.flop_bound import H200_FP8_PEAK_FLOPS

    script = load_benchmark_script("bounds.py")
    args = ("micro:64:16:4#16", ["batchllm"], "llama-3.1-8b", 4096, 16, 5, 256)
    (bf16,) = script.bound_rows(*args)
    (fp8,) = script.bound_rows(*args, quantization="fp8")
    (slow,) = script.bound_rows(*args, attention_flops_rate=100e12, quantization="fp8")
    assert fp8["steps"] == bf16["steps"] and fp8["quantization"] == "fp8"
    assert fp8["flop_bound_s"] == pytest.approx(bf16["flop_bound_s"] * H200_BF16_PEAK_FLOPS / H200_FP8_PEAK_FLOPS,
                                                rel=1e-4)
    # 16 requests of 80 tokens read every weight each step: one-byte weights halve all but the
    # LM head's reads (1 GB of the 16 GB bf16 model stays bf16)
    assert 0.5 * bf16["roofline_s"] < fp8["roofline_s"] < 0.55 * bf16["roofline_s"]
    assert slow["attention_roofline_s"] > fp8["attention_roofline_s"]
    assert slow["serial_at_gemm_rate_s"] - fp8["serial_at_gemm_rate_s"] == pytest.approx(
        slow["attention_roofline_s"] - fp8["attention_roofline_s"], abs=2e-6)  # rows keep 5 digits
    assert slow["serial_roofline_s"] == fp8["serial_roofline_s"]


def test_attention_rate_must_be_positive():
    with pytest.raises(SystemExit):
        load_benchmark_script("bounds.py").main(["--attention-tflops", "-1"])
