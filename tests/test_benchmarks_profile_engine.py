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
