"""The KV of a dense call (ops/prefix_attention.py, `_dense_output`) gathered from the paged cache
into contiguous [batch, positions, num_kv_heads, head_dim] tensors in the library kernel's dtype,
K and V in one launch.

A call's KV is `kv_len` positions that start `offset` into a run of cache blocks (a batch of
causal squares: `batch` such runs, one after another in `blocks`), padded with zero positions
up to `padded_len` (a causal square's rows padded up to the dense calls' sizes). Gathering it
with PyTorch takes six launches and three round trips through memory (index_select of whole
blocks, the conversion of an FP8 cache to the query dtype, the zero padding); this kernel reads
each position once and writes it once, converted (exact: every e4m3 value is a float16 /
bfloat16 one). `gather_dense_kv_reference` is that PyTorch chain, the kernel's reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from batchllm.attention_plan.checks import check, next_power_of_2

POSITIONS_PER_PROGRAM = 16


@triton.jit
def _gather_dense_kv_kernel(
    k_cache_ptr, v_cache_ptr,  # [num_blocks, PAGE, num_kv_heads, head_dim], (heads, head_dim) contiguous
    blocks_ptr,  # [batch * blocks_per_run] int32: each batch entry's run of cache blocks
    k_out_ptr, v_out_ptr,  # [batch, padded_len, num_kv_heads * head_dim], contiguous
    blocks_per_run, offset, kv_len, padded_len, stride_cb, stride_cs,
    PAGE: tl.constexpr, ROW: tl.constexpr, BLOCK_ROW: tl.constexpr, BLOCK_T: tl.constexpr,
):
    tile = tl.program_id(0)
    entry = tl.program_id(1).to(tl.int64)
    positions = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_ROW)
    in_row = cols < ROW
    inside = positions < padded_len
    valid = positions < kv_len
    logical = offset + positions
    block = tl.load(blocks_ptr + entry * blocks_per_run + logical // PAGE, mask=valid, other=0).to(tl.int64)
    src = block * stride_cb + (logical % PAGE) * stride_cs
    load_mask = valid[:, None] & in_row[None, :]
    k = tl.load(k_cache_ptr + src[:, None] + cols[None, :], mask=load_mask, other=0.0)
    v = tl.load(v_cache_ptr + src[:, None] + cols[None, :], mask=load_mask, other=0.0)
    dst = (entry * padded_len + positions).to(tl.int64)[:, None] * ROW + cols[None, :]
    store_mask = inside[:, None] & in_row[None, :]
    tl.store(k_out_ptr + dst, k.to(k_out_ptr.dtype.element_ty), mask=store_mask)
    tl.store(v_out_ptr + dst, v.to(v_out_ptr.dtype.element_ty), mask=store_mask)


def gather_dense_kv_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, batch: int,
                              offset: int, kv_len: int, padded_len: int,
                              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """gather_dense_kv by PyTorch ops: the kernel's reference, and the path for caches whose
    heads are not one contiguous row."""
    positions = slice(offset, offset + kv_len)
    key, value = (cache.index_select(0, blocks).view(batch, -1, *cache.shape[2:])[:, positions].to(dtype)
                  for cache in (k_cache, v_cache))
    if padded_len > kv_len:
        key, value = (F.pad(t, (0, 0, 0, 0, 0, padded_len - kv_len)) for t in (key, value))
    return key, value


def gather_dense_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, batch: int, offset: int,
                    kv_len: int, padded_len: int, dtype: torch.dtype,
                    out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """k_cache / v_cache [num_blocks, block_size, num_kv_heads, head_dim]; blocks [batch * n] int32,
    each batch entry's n blocks in order (n * block_size >= offset + kv_len). Returns (key, value),
    each [batch, padded_len, num_kv_heads, head_dim] contiguous in `dtype`: entry b's positions
    offset .. offset + kv_len - 1, then zeros up to padded_len. out: the two tensors to write
    (contiguous, of that shape and dtype; slices of a larger buffer, for one), else new ones."""
    check(k_cache.dim() == 4 and v_cache.shape == k_cache.shape and k_cache.stride() == v_cache.stride(),
          f"caches must be [num_blocks, block_size, num_kv_heads, head_dim] with one layout, got "
          f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    check(batch >= 1 and blocks.dim() == 1 and blocks.shape[0] % batch == 0,
          f"blocks must be a run of equal length per batch entry, got {blocks.shape[0]} for {batch}")
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    blocks_per_run = blocks.shape[0] // batch
    check(0 <= offset and 0 <= kv_len <= padded_len and offset + kv_len <= blocks_per_run * block_size,
          f"positions {offset} + {kv_len} (padded to {padded_len}) do not fit {blocks_per_run} blocks")
    row = num_kv_heads * head_dim
    shape = (batch, padded_len, num_kv_heads, head_dim)
    if out is not None:
        check(all(t.shape == shape and t.dtype == dtype and t.is_contiguous() for t in out),
              f"out must be two contiguous {dtype} tensors of shape {shape}, got "
              f"{[(tuple(t.shape), t.dtype) for t in out]}")
    if k_cache.stride(3) != 1 or k_cache.stride(2) != head_dim:  # a view whose heads are not one row
        key, value = gather_dense_kv_reference(k_cache, v_cache, blocks, batch, offset, kv_len, padded_len, dtype)
        if out is None:
            return key, value
        out[0].copy_(key)
        out[1].copy_(value)
        return out
    key, value = out if out is not None else (torch.empty(shape, dtype=dtype, device=k_cache.device),
                                              torch.empty(shape, dtype=dtype, device=k_cache.device))
    if padded_len:
        grid = (triton.cdiv(padded_len, POSITIONS_PER_PROGRAM), batch)
        _gather_dense_kv_kernel[grid](
            k_cache, v_cache, blocks, key, value, blocks_per_run, offset, kv_len, padded_len,
            k_cache.stride(0), k_cache.stride(1),
            PAGE=block_size, ROW=row, BLOCK_ROW=next_power_of_2(row), BLOCK_T=POSITIONS_PER_PROGRAM,
            num_warps=4)
    return key, value
