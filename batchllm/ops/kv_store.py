"""Triton kernel writing a step's new K/V rows into the paged KV cache (BatchLLM section 5).

Slots follow the KV addressing rule of batchllm/sched/interface.py; the host computes them
(slot_mapping = block_id * block_size + offset, negative = skip the row). Into a float8_e4m3fn
cache the rows go quantized (batchllm/ops/kv_quant.py): divided by the cache's scale, clamped to
the largest finite e4m3 and rounded to nearest even in the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchllm.attention_plan.checks import check, next_power_of_2
from batchllm.ops.fp8 import FP8_MAX
from batchllm.ops.kv_quant import check_kv_scales, is_fp8


_QUANTIZABLE = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _quantize(x, scale, MAX: tl.constexpr):
    """x / scale in float32 (IEEE division, as the reference), clamped to [-MAX, MAX]; the store
    rounds it to e4m3."""
    q = tl.math.div_rn(x.to(tl.float32), scale)
    return tl.minimum(tl.maximum(q, -MAX), MAX)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_ptr,  # [num_tokens] int64
    k_scale, v_scale,  # float: the FP8 caches' scales (read only with QUANTIZE)
    stride_key_t, stride_key_h, stride_value_t, stride_value_h,
    stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    QUANTIZE: tl.constexpr,  # the caches are float8_e4m3fn
    FP8_MAX: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, HEAD_DIM)
        mask = (offs_h < NUM_KV_HEADS)[:, None]
        token64 = token.to(tl.int64)
        k = tl.load(key_ptr + token64 * stride_key_t + offs_h[:, None] * stride_key_h + offs_d[None, :],
                    mask=mask)
        v = tl.load(value_ptr + token64 * stride_value_t + offs_h[:, None] * stride_value_h
                    + offs_d[None, :], mask=mask)
        if QUANTIZE:
            k = _quantize(k, k_scale, FP8_MAX)
            v = _quantize(v, v_scale, FP8_MAX)
        k_dst = k_cache_ptr + block * stride_kc_b + offset * stride_kc_s + offs_h[:, None] * stride_kc_h
        v_dst = v_cache_ptr + block * stride_vc_b + offset * stride_vc_s + offs_h[:, None] * stride_vc_h
        tl.store(k_dst + offs_d[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst + offs_d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; negative = skip the row
    k_scale: float = 1.0,  # float8_e4m3fn caches: stored = e4m3(clamp(key / k_scale, -448, 448))
    v_scale: float = 1.0,
) -> None:
    """Write key/value rows into the paged caches at slot_mapping (in place); quantized into a
    float8_e4m3fn cache, whose scales k_scale / v_scale must then be given."""
    check(key.dim() == 3 and value.shape == key.shape, f"key/value must be [T, Hkv, D], got {tuple(key.shape)} / {tuple(value.shape)}")
    check(k_cache.dim() == 4 and v_cache.shape == k_cache.shape, f"caches must be [N, B, Hkv, D], got {tuple(k_cache.shape)}")
    num_tokens, num_kv_heads, head_dim = key.shape
    check(k_cache.shape[2:] == (num_kv_heads, head_dim), f"cache heads/dim {tuple(k_cache.shape[2:])} != key {(num_kv_heads, head_dim)}")
    check(slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64, "slot_mapping must be [num_tokens] int64")
    check(head_dim == next_power_of_2(head_dim), f"head_dim must be a power of 2, got {head_dim}")
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        check(t.stride(-1) == 1, f"{name} must be contiguous in head_dim")
    check(k_cache.dtype == v_cache.dtype, "k_cache and v_cache dtypes differ")
    check_kv_scales(k_scale, v_scale, k_cache.dtype)
    if is_fp8(k_cache.dtype):
        check(key.dtype in _QUANTIZABLE and value.dtype == key.dtype,
              f"a float8_e4m3fn cache stores float16, bfloat16 or float32 key/value rows, "
              f"got {key.dtype} / {value.dtype}")
    check(len({key.device, value.device, k_cache.device, slot_mapping.device}) == 1, "all tensors must be on one device")
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, float(k_scale), float(v_scale),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=next_power_of_2(num_kv_heads), QUANTIZE=is_fp8(k_cache.dtype), FP8_MAX=FP8_MAX,
        num_warps=1 if head_dim * num_kv_heads <= 512 else 4,
    )
