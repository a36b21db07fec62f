"""benchmarks/scale_out_tp.py helpers on the CPU."""

from script_loader import load_benchmark_script


def test_busy_time_is_the_union_of_kernel_spans():
    busy_us = load_benchmark_script("scale_out_tp.py").busy_us
    assert busy_us([]) == 0.0
    # overlapping (a collective on its own stream beside a GEMM), nested, touching and apart
    spans = [(10.0, 20.0), (15.0, 30.0), (16.0, 18.0), (30.0, 35.0), (50.0, 55.0)]
    assert busy_us(spans) == 30.0
    assert busy_us(list(reversed(spans))) == 30.0


def test_kernel_classes_by_name():
    kernel_class = load_benchmark_script("scale_out_tp.py").kernel_class
    assert kernel_class("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "collective"
    assert kernel_class("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTT") == "gemm"
    assert kernel_class("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64") == "gemm"
    assert kernel_class("_prefix_shared_attention_kernel") == "attention"
    assert kernel_class("triton_red_fused_rms_norm_0") == "other"


def test_phase_times_split_decode_only_steps_from_prompt_steps():
    from batchllm.sched.trace import StepRecord

    phase_ms_per_step = load_benchmark_script("scale_out_tp.py").phase_ms_per_step
    steps = [StepRecord(0, 0, 100, 2000, 4, 10, 0.3), StepRecord(1, 4, 0, 0, 4, 10, 0.1),
             StepRecord(2, 4, 0, 0, 4, 10, 0.2)]
    phases = phase_ms_per_step(steps)
    assert phases["decode_only_steps"] == 2
    assert phases["decode_only_step_ms"] == 150.0
    assert phases["prompt_step_ms"] == 300.0
    assert phases["step_ms"] == 200.0


def test_throughput_row_on_a_tiny_model(tmp_path, capsys):
    import json

    out = tmp_path / "tp.jsonl"
    load_benchmark_script("scale_out_tp.py").main(
        ["--model", "random:tiny?vocab_size=32000", "--tp", "1", "--workload", "micro:64:8:4#8", "--output-tokens", "4",
         "--kv-cache-tokens", "4096", "--out", str(out)])
    row = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == row
    assert (row["what"], row["tp"], row["workload"]) == ("tp_throughput", 1, "micro:64:8:4#8")
    assert (row["requests"], row["prompt_tokens"], row["output_tokens"]) == (8, 8 * 72, 8 * 4)
    assert (row["steps"], row["decode_only_steps"], row["kv_cache_tokens"]) == (4, 3, 4096)
    assert row["seconds"] > 0 and row["time_over_bound"] > 1  # the tiny model's bound is microseconds
