"""Triton kernels of FP8 activation quantization (the rounding rule is in fp8.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchllm.attention_plan.checks import check
from batchllm.ops.fp8 import FP8_DTYPE, QuantizedActivation


@triton.jit
def quantize_block(x, amax, static_scale_ptr, STATIC: tl.constexpr):
    """(e4m3 values of x, the row's float32 scale): per row from its amax, or the static scale."""
    if STATIC:
        scale = tl.load(static_scale_ptr)
        inv = tl.math.div_rn(1.0, scale)
    else:
        amax = tl.maximum(amax, 1e-12)
        inv = tl.math.div_rn(448.0, amax)
        scale = tl.math.div_rn(amax, 448.0)
    q = tl.clamp(x * inv, -448.0, 448.0).to(tl.float16).to(tl.float8e4nv)
    return q, scale


@triton.jit
def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, static_scale_ptr, stride_x, stride_o, num_cols,
                          STATIC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    q, scale = quantize_block(x, tl.max(tl.abs(x), 0), static_scale_ptr, STATIC)
    tl.store(out_ptr + row * stride_o + cols, q, mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_rows(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> QuantizedActivation:
    """The Triton kernel of quantize_rows_reference (GPU): one program per row."""
    check(x.dim() == 2 and x.stride(-1) == 1, f"x must be [T, K] contiguous in K, got {tuple(x.shape)}")
    num_rows, num_cols = x.shape
    values = torch.empty((num_rows, num_cols), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    if num_rows:
        block = triton.next_power_of_2(num_cols)
        _quantize_rows_kernel[(num_rows,)](
            x, values, scales, scales if static_scale is None else static_scale, x.stride(0), values.stride(0),
            num_cols, STATIC=static_scale is not None, BLOCK=block, num_warps=min(max(block // 512, 1), 16),
        )
    return QuantizedActivation(values, scales)
