"""Programs per SM of a compiled kernel (CUDA's allocation rules, H100/H200 limits): the count a
persistent grid must not exceed to run in one wave."""

import pytest
import torch

from batchllm.ops.occupancy import resident_programs

H200 = {"regs_per_sm": 65536, "shared_per_sm": 233472, "threads_per_sm": 2048}


@pytest.mark.parametrize("num_regs, shared_bytes, num_warps, expected", [
    (128, 22528, 4, 4),  # 128 x 32 x 4 = 16384 registers a program: exactly 4
    (149, 22528, 4, 3),  # rounded to 152 a thread: 19456 a program
    (121, 22528, 4, 4),  # 121 rounds up to 128
    (80, 22528, 4, 6),
    (168, 74752, 4, 3),  # 3 x (73 KiB + the reserved 1 KiB) fit in 228 KiB
    (128, 77824, 4, 2),  # shared memory: a third 77 KiB program does not fit
    (32, 0, 4, 16),  # threads: 2048 / 128
    (255, 0, 8, 1),
    (16, 0, 1, 32),  # at most 32 blocks an SM
])
def test_resident_programs(num_regs, shared_bytes, num_warps, expected):
    assert resident_programs(num_regs, shared_bytes, num_warps, **H200) == expected


def test_a_program_too_large_for_an_sm_counts_as_one():
    assert resident_programs(255, 300_000, 4, **H200) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("kv_fp8", [True, False], ids=["fp8", "bf16"])
def test_decode_small_launch_keeps_its_programs_per_sm(kv_fp8):
    """The SMALL launch of a decode graph compiles to a kernel of which an SM holds the
    graph_programs_per_sm programs its tile asks for (else the persistent grid would shrink)."""
    from dataclasses import replace

    from batchllm.attention_plan.tile_config import decode_tile_config
    from batchllm.attention_plan.work_list import build_prefix_shared_plan
    from batchllm.ops.attention_kernels import work_list_attention_kernel
    from batchllm.ops.occupancy import kernel_programs_per_sm
    from batchllm.ops.plan_device import device_num_sms, plan_to_device
    from batchllm.ops.prefix_attention import launch_arguments
    from synthetic_batch import SeqSpec, make_batch

    tile = decode_tile_config(128, 4, kv_fp8=kv_fp8)
    b = make_batch([SeqSpec(1, 700 + 11 * i) for i in range(12)], num_heads=32, num_kv_heads=8, head_dim=128,
                   block_size=16, dtype=torch.bfloat16, device="cuda")
    plan = build_prefix_shared_plan(**b.metadata_numpy(), block_size=16, num_kv_heads=8, num_heads=32, head_dim=128,
                                    tile=tile, num_sms=device_num_sms("cuda"))
    plan = replace(plan_to_device(plan, "cuda"), num_items=torch.tensor([0, 12, 0], dtype=torch.int32, device="cuda"),
                   persistent_programs=device_num_sms("cuda") * tile.graph_programs_per_sm)
    caches = (b.k_cache.to(torch.float8_e4m3fn), b.v_cache.to(torch.float8_e4m3fn)) if kv_fp8 else (b.k_cache, b.v_cache)
    out, part = torch.empty_like(b.query), torch.empty(16, 32, 128, device="cuda")
    args, constants = launch_arguments(plan.work_small, b.query, *caches, plan, out, part, part[:, :, 0], 0.1,
                                       classes=1, num_items=plan.num_items[1:])
    compiled = work_list_attention_kernel.warmup(*args, grid=(1,), **constants)
    assert kernel_programs_per_sm(compiled, torch.device("cuda")) >= tile.graph_programs_per_sm
