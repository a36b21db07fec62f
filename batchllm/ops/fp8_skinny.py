"""The FP8 GEMM of steps with few rows (decode steps of small batches): y [M, N] = (x * x_scales) @
(W * w_scales).T (+ bias) in the model dtype, x [M, K] and W [N, K] in e4m3, as ops/fp8.fp8_linear.

At up to 128 rows a linear layer only has to stream its weights; cuBLASLt's `_scaled_mm` read
Llama-3.1-8B's at 1.2-1.8 TB/s there (o and down) where the H200 reads 4.2. Each program owns
BLOCK_N output channels and streams their [BLOCK_N, K] weights through a software pipeline, the
rows riding along as the MMA's narrow side (W @ x^T, so BLOCK_M can be 16). Where N / BLOCK_N
programs are too few to keep the memory system busy, K is split over SPLIT_K programs: each stores
its float32 partial in the workspace and counts itself in on its tile's counter; the last one sums
the partials in split order (the result does not depend on which finishes first), applies the
scales, writes the output and resets the counter for the next call. Tiles: ops/fp8.skinny_config.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchllm.attention_plan.checks import check
from batchllm.ops.fp8 import SKINNY_MAX_ROWS, QuantizedActivation, SkinnyConfig, SkinnyWorkspace


@triton.jit
def _store_scaled(acc, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, rows, cols, row_mask, stride_out,
                  HAS_BIAS: tl.constexpr):
    x_scale = tl.load(x_scale_ptr + rows, mask=row_mask, other=0.0)
    w_scale = tl.load(w_scale_ptr + cols)
    y = acc * w_scale[:, None] * x_scale[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols).to(tl.float32)[:, None]
    tl.store(out_ptr + rows[None, :] * stride_out + cols[:, None], y.to(out_ptr.dtype.element_ty),
             mask=row_mask[None, :])


@triton.jit
def _skinny_fp8_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
                       num_rows, num_cols, k_per_split, stride_x, stride_w, stride_out,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                       PARTIAL_ROWS: tl.constexpr):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    k_offsets = split * k_per_split + tl.arange(0, BLOCK_K)
    row_mask = rows < num_rows
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_w + k_offsets[None, :]
    x_ptrs = x_ptr + rows[:, None] * stride_x + k_offsets[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for _ in tl.range(0, k_per_split, BLOCK_K, num_stages=NUM_STAGES):
        w = tl.load(w_ptrs)
        x = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if SPLIT_K > 1:
        # partials [SPLIT_K, num_cols, PARTIAL_ROWS]: this split's slice, then the tile's counter
        tl.store(partial_ptr + (split * num_cols + cols[:, None]) * PARTIAL_ROWS + rows[None, :], acc,
                 mask=row_mask[None, :])
        tl.debug_barrier()  # every thread's partial is written before the count releases them
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for other in range(SPLIT_K):  # in split order, whichever program arrived last
                acc += tl.load(partial_ptr + (other * num_cols + cols[:, None]) * PARTIAL_ROWS + rows[None, :],
                               mask=row_mask[None, :], other=0.0, cache_modifier=".cg")
            _store_scaled(acc, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, rows, cols, row_mask, stride_out,
                          HAS_BIAS)
            tl.atomic_xchg(counter_ptr + tile, 0)
    else:
        _store_scaled(acc, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, rows, cols, row_mask, stride_out, HAS_BIAS)


def skinny_fp8_linear(x: QuantizedActivation, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None, out_dtype: torch.dtype, config: SkinnyConfig,
                      workspace: SkinnyWorkspace) -> torch.Tensor:
    """fp8_linear's product by the kernel above: x.values [M, K] with 1 <= M <= SKINNY_MAX_ROWS and
    one float32 scale a row, weight [N, K] with N and K divisible into `config`'s tiles."""
    values, scales = x.values, x.scales
    num_rows, k = values.shape
    n = weight.shape[0]
    check(values.stride(-1) == 1 and weight.stride(-1) == 1, "x and weight must be contiguous in K")
    check(weight.shape[1] == k, f"x has {k} columns, the weight {weight.shape[1]}")
    check(0 < num_rows <= SKINNY_MAX_ROWS, f"the skinny GEMM takes 1-{SKINNY_MAX_ROWS} rows, got {num_rows}")
    check(n % config.block_n == 0 and k % (config.block_k * config.split_k) == 0,
          f"a [{n}, {k}] weight does not divide into {config}")
    check(scales.numel() == num_rows and scales.is_contiguous(), "x needs one contiguous float32 scale a row")
    out = torch.empty((num_rows, n), dtype=out_dtype, device=values.device)
    if config.split_k > 1:
        partials, counters = workspace.get(n, config, values.device)
    else:
        partials = counters = weight_scale  # not read
    _skinny_fp8_kernel[(n // config.block_n, config.split_k)](
        values, scales, weight, weight_scale, weight_scale if bias is None else bias, out, partials, counters,
        num_rows, n, k // config.split_k, values.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=max(16, triton.next_power_of_2(num_rows)), BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, SPLIT_K=config.split_k, NUM_STAGES=config.num_stages,
        PARTIAL_ROWS=SKINNY_MAX_ROWS, num_warps=config.num_warps,
    )
    return out
