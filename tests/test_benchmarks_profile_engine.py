"""benchmarks/profile_engine.py: kernel names land in the right category. cuDNN's attention
kernels hold "sm90" as the GEMMs' names do, and once counted as GEMMs."""

from script_loader import load_benchmark_script


def test_kernel_categories():
    category = load_benchmark_script("profile_engine.py")._category
    names = {
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1": "attention",
        "work_list_attention_kernel": "attention",
        "merge_partials_kernel": "attention",
        "void at::native::vectorized_gather_kernel<16, int>(char*, char*, int*, int, long, long, lo": "attention_gather",
        "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT": "gemm",
        "_store_kv_kernel": "kv_store",
        "_rms_norm_kernel": "norm_rope_silu",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::Tenso": "other",
    }
    assert {name: category(name) for name in names} == names


def test_steps_split_by_kind_and_their_means():
    from types import SimpleNamespace

    profile_engine = load_benchmark_script("profile_engine.py")

    def step(distinct, prefix, launch_s):
        return SimpleNamespace(num_distinct_tokens=distinct, num_prefix_tokens=prefix, launch_time_s=launch_s)

    steps = [step(0, 0, 0.002), step(512, 0, 0.030), step(0, 1024, 0.020), step(0, 0, 0.004)]
    kinds = profile_engine.steps_by_kind(steps)
    assert {name: [steps.index(s) for s in group] for name, group in kinds.items()} == {
        "decode_only": [0, 3], "with_prefill": [1, 2]}
    assert profile_engine.mean_ms(kinds["with_prefill"], "launch_time_s") == 25.0
    assert profile_engine.mean_ms(kinds["decode_only"], "launch_time_s") == 3.0
    assert list(profile_engine.steps_by_kind(steps[:1])) == ["decode_only"]  # an empty kind is left out
