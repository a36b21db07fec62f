"""benchmarks/profile_engine.py: kernel names land in the right category (cuDNN's attention
kernels hold "sm90" as the GEMMs' names do, and once counted as GEMMs), steps split by kind, and
the host mode runs end to end on a tiny model."""

import json

import torch
from script_loader import load_benchmark_script

profile_engine = load_benchmark_script("profile_engine.py")


def test_kernel_categories():
    names = {
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1": "attention",
        "work_list_attention_kernel": "attention",
        "merge_partials_kernel": "attention",
        "void flashinfer::FP8PrefillWithKVCacheKernel<flashinfer::FP8CollectiveMainloop<RaggedParam": "fa3",
        "kernel_mha(unsigned int, float, float const*, Vec<__nv_bfloat16, 128u>*, Vec<__nv_bfloat16": "xqa",
        "void at::native::vectorized_gather_kernel<16, int>(char*, char*, int*, int, long, long, lo": "attention_gather",
        "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT": "gemm",
        "_store_kv_kernel": "kv_store",
        "_rms_norm_kernel": "norm_rope_silu",
        "_quantize_query_kernel": "norm_rope_silu",
        "_query_amax_kernel": "norm_rope_silu",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::Tenso": "other",
    }
    assert {name: profile_engine.kernel_category(name) for name in names} == names


def test_steps_split_by_kind_and_their_means():
    from types import SimpleNamespace

    def step(distinct, prefix, launch_s):
        return SimpleNamespace(num_distinct_tokens=distinct, num_prefix_tokens=prefix, launch_time_s=launch_s)

    steps = [step(0, 0, 0.002), step(512, 0, 0.030), step(0, 1024, 0.020), step(0, 0, 0.004)]
    kinds = profile_engine.steps_by_kind(steps)
    assert {name: [steps.index(s) for s in group] for name, group in kinds.items()} == {
        "decode_only": [0, 3], "with_prefill": [1, 2]}
    assert profile_engine.mean_ms(kinds["with_prefill"], "launch_time_s") == 25.0
    assert profile_engine.mean_ms(kinds["decode_only"], "launch_time_s") == 3.0
    assert list(profile_engine.steps_by_kind(steps[:1])) == ["decode_only"]  # an empty kind is left out


def test_host_mode_on_a_tiny_model_profiles_every_step(tmp_path):
    out = tmp_path / "host_profile.json"
    argv = ["host", "--model", "random:tiny?vocab_size=4096", "--workload", "micro:64:8:4", "--requests", "8",
            "--output-tokens", "3", "--top", "5", "--out", str(out)]
    assert profile_engine.main(argv) == 0
    result = json.loads(out.read_text())
    steps = result["profiled_run"]["all"]["steps"]
    assert steps == result["plain_run"]["all"]["steps"] > 0
    kinds = result["execute_profile"]
    assert sum(kind["steps"] for kind in kinds.values()) == steps  # one execute call a step
    if not torch.cuda.is_available():  # no CUDA graphs: every step is eager
        assert list(kinds) == ["eager"]
    eager = kinds["eager"]  # the first step has prefill chunks
    assert eager["profiled_ms_per_step"] > 0 and len(eager["top_functions"]) == 5
    assert result["requests"] == 8 and result["quantization"] is None


def test_gpu_mode_summarises_each_window(tmp_path):
    """On the CPU no kernel is recorded, but the windows and their steps are those asked for."""
    out = tmp_path / "profile.json"
    argv = ["gpu", "--model", "random:tiny?vocab_size=4096", "--workload", "micro:64:8:4", "--requests", "16",
            "--output-tokens", "4", "--windows", "1:2,2:4", "--out", str(out)]
    assert profile_engine.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["phases"]["all"]["steps"] == 4 and result["phases"]["decode_only"]["steps"] == 3
    windows = result["windows"]
    assert [w["steps"] for w in windows] == [[1, 2], [2, 4]]
    assert [(w["mean_tokens"], w["mean_decode_rows"]) for w in windows] == [(16.0, 16.0), (16.0, 16.0)]
    assert all(w["wall_ms_per_step"] > 0 for w in windows)


def test_gpu_mode_names_the_windows_past_the_run(tmp_path, capsys):
    # A larger token budget runs the same work in fewer steps: a window the run never reached is
    # said, not dropped without a word.
    out = tmp_path / "profile.json"
    argv = ["gpu", "--model", "random:tiny?vocab_size=4096", "--workload", "micro:64:8:4", "--requests", "16",
            "--output-tokens", "4", "--windows", "1:2,5:7", "--out", str(out)]
    assert profile_engine.main(argv) == 0
    assert [w["steps"] for w in json.loads(out.read_text())["windows"]] == [[1, 2]]
    assert "the run took 4 steps; windows 5:7 were not profiled" in capsys.readouterr().err
