"""Fused element-wise kernels of the decoder layer (GPU path).

Eager PyTorch spends ~25 launches per layer on RMSNorm, RoPE and SwiGLU; at 8B with a few hundred
decode rows the step is bound by launching them (measured: benchmarks/profile_engine.py). Each kernel
here replaces one of those chains with a single launch and keeps the exact rounding of the
PyTorch path (the model's own code in models/):
  rms_norm:      (x [+ residual]) -> normalised in float32, cast to x.dtype, times weight (the sum
                 x + residual may overwrite residual: the residual stream updated in place)
  silu_and_mul:  [T, 2I] -> silu(gate) * up, [T, I]
  rope_inplace:  rotate-half RoPE on q and k rows, float32 math, written back in place (or the
                 query into a buffer of its own)
With `fp8=True` (an FP8 linear layer reads the output), rms_norm and silu_and_mul also quantize
their output per token (ops/fp8.py): the model-dtype result is rounded first, then scaled to e4m3,
so the activation never makes a round trip through memory in the model dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchllm.attention_plan.checks import check, next_power_of_2
from batchllm.ops.fp8 import FP8_DTYPE, QuantizedActivation
from batchllm.ops.fp8_kernels import quantize_block


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, scale_ptr, static_scale_ptr,
                     stride_x, stride_r, stride_o, stride_ro, hidden_size, eps, HAS_RESIDUAL: tl.constexpr,
                     FP8: tl.constexpr, STATIC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to the model dtype first, as `hidden = hidden + residual` does.
        x = x + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / hidden_size
    normed = (x32 * tl.math.rsqrt(variance + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = (normed.to(tl.float32) * weight.to(tl.float32)).to(x.dtype)
    if FP8:
        out32 = out.to(tl.float32)
        q, scale = quantize_block(out32, tl.max(tl.abs(out32), 0), static_scale_ptr, STATIC)
        tl.store(out_ptr + row * stride_o + cols, q, mask=mask)
        tl.store(scale_ptr + row, scale)
    else:
        tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             fp8: bool = False, static_scale: torch.Tensor | None = None, residual_out: torch.Tensor | None = None
             ) -> tuple[torch.Tensor | QuantizedActivation, torch.Tensor]:
    """x, residual: [T, hidden]; weight: [hidden]. Returns (normed, new_residual), where
    new_residual = x + residual (or x itself when residual is None), written to residual_out when
    given (residual itself: the residual stream updated in place; each row is read before it is
    written). fp8: normed is a QuantizedActivation (per-token scales, or static_scale for every row)."""
    check(x.dim() == 2 and x.stride(-1) == 1, f"x must be [T, hidden] contiguous in hidden, got {tuple(x.shape)}")
    check(weight.shape == (x.shape[1],), f"weight must be [{x.shape[1]}], got {tuple(weight.shape)}")
    num_tokens, hidden_size = x.shape
    out = torch.empty_like(x, dtype=FP8_DTYPE if fp8 else x.dtype)
    scales = torch.empty((num_tokens, 1), dtype=torch.float32, device=x.device) if fp8 else out
    if residual is not None:
        check(residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x")
        if residual_out is None:
            residual_out = torch.empty_like(x)
        check(residual_out.shape == x.shape and residual_out.dtype == x.dtype and residual_out.stride(-1) == 1,
              "residual_out must match x")
    else:
        residual, residual_out = x, x
    if num_tokens:
        block = next_power_of_2(hidden_size)
        _rms_norm_kernel[(num_tokens,)](
            x, residual, weight, out, residual_out, scales, scales if static_scale is None else static_scale,
            x.stride(0), residual.stride(0), out.stride(0), residual_out.stride(0), hidden_size, eps,
            HAS_RESIDUAL=residual is not x, FP8=fp8, STATIC=static_scale is not None, BLOCK=block,
            num_warps=min(max(block // 512, 1), 16),
        )
    return (QuantizedActivation(out, scales) if fp8 else out), residual_out


@triton.jit
def _silu_mul_block(x_ptr, row, stride_x, cols, intermediate_size):
    """silu(gate) * up of one row's columns, rounded as F.silu(gate) * up rounds (silu to the
    model dtype before the product), returned in float32."""
    mask = cols < intermediate_size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + intermediate_size + cols, mask=mask, other=0.0)
    gate32 = gate.to(tl.float32)
    silu = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype)
    return (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype).to(tl.float32), mask


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, intermediate_size, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    value, mask = _silu_mul_block(x_ptr, row, stride_x, cols, intermediate_size)
    tl.store(out_ptr + row * stride_o + cols, value.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, out_ptr, scale_ptr, static_scale_ptr, stride_x, stride_o, intermediate_size,
                             STATIC: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
    """One program per row. ONE_PASS (BLOCK covers the row): the row is read once, its amax taken
    in registers. Otherwise a first pass finds the row's amax and a second recomputes and quantizes
    (recomputing is cheaper than a round trip of the model-dtype row through memory)."""
    row = tl.program_id(0)
    if ONE_PASS:
        cols = tl.arange(0, BLOCK)
        value, mask = _silu_mul_block(x_ptr, row, stride_x, cols, intermediate_size)
        q, scale = quantize_block(value, tl.max(tl.abs(value), 0), static_scale_ptr, STATIC)
        tl.store(out_ptr + row * stride_o + cols, q, mask=mask)
    else:
        amax = 0.0
        if not STATIC:
            for start in range(0, intermediate_size, BLOCK):
                value, mask = _silu_mul_block(x_ptr, row, stride_x, start + tl.arange(0, BLOCK), intermediate_size)
                amax = tl.maximum(amax, tl.max(tl.abs(value), 0))
        scale = 0.0
        for start in range(0, intermediate_size, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            value, mask = _silu_mul_block(x_ptr, row, stride_x, cols, intermediate_size)
            q, scale = quantize_block(value, amax, static_scale_ptr, STATIC)
            tl.store(out_ptr + row * stride_o + cols, q, mask=mask)
    tl.store(scale_ptr + row, scale)


# Rows up to this many columns are read once (ONE_PASS): on the H200, 8192 rows of 14336 columns in
# 0.148 ms with 8 warps (0.156 with 16) against 0.248 in two passes; FP8 uniform 2048/128 +2.2-2.5%.
MAX_ONE_PASS_COLUMNS = 16384


def silu_and_mul(gate_up: torch.Tensor, fp8: bool = False,
                 static_scale: torch.Tensor | None = None) -> torch.Tensor | QuantizedActivation:
    """gate_up: [T, 2I] (gate first) -> [T, I]; fp8: a QuantizedActivation (per-token scales, or
    static_scale for every row)."""
    check(gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and gate_up.stride(-1) == 1,
          f"gate_up must be [T, 2I] contiguous, got {tuple(gate_up.shape)}")
    num_tokens, double = gate_up.shape
    intermediate_size = double // 2
    if fp8:
        values = torch.empty((num_tokens, intermediate_size), dtype=FP8_DTYPE, device=gate_up.device)
        scales = torch.empty((num_tokens, 1), dtype=torch.float32, device=gate_up.device)
        if num_tokens:
            block = next_power_of_2(intermediate_size)
            one_pass = block <= MAX_ONE_PASS_COLUMNS
            _silu_and_mul_fp8_kernel[(num_tokens,)](
                gate_up, values, scales, scales if static_scale is None else static_scale, gate_up.stride(0),
                values.stride(0), intermediate_size, STATIC=static_scale is not None,
                BLOCK=block if one_pass else 2048, ONE_PASS=one_pass,
                num_warps=min(max(block // 2048, 4), 8) if one_pass else 8)
        return QuantizedActivation(values, scales)
    out = torch.empty((num_tokens, intermediate_size), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        block = 1024
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(intermediate_size, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), intermediate_size, BLOCK=block, num_warps=4)
    return out


@triton.jit
def _rope_rows(x_ptr, out_ptr, row, stride_t, stride_h, stride_out_t, stride_out_h, num_heads, cos1, sin1, cos2,
               sin2, HEADS: tl.constexpr, HALF: tl.constexpr):
    heads = tl.arange(0, HEADS)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    mask = heads < num_heads
    base = x_ptr + row * stride_t + heads * stride_h + dims
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    out = out_ptr + row * stride_out_t + heads * stride_out_h + dims
    tl.store(out, (a * cos1 - b * sin1).to(x1.dtype), mask=mask)
    tl.store(out + HALF, (b * cos2 + a * sin2).to(x1.dtype), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, q_out_ptr, k_ptr, positions_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_qot,
                 stride_qoh, stride_kt, stride_kh, stride_table, num_q_heads, num_k_heads, Q_HEADS: tl.constexpr,
                 K_HEADS: tl.constexpr, HALF: tl.constexpr):
    row = tl.program_id(0)
    position = tl.load(positions_ptr + row)
    dims = tl.arange(0, HALF)[None, :]
    table = position * stride_table + dims
    cos1 = tl.load(cos_ptr + table)
    sin1 = tl.load(sin_ptr + table)
    cos2 = tl.load(cos_ptr + table + HALF)
    sin2 = tl.load(sin_ptr + table + HALF)
    _rope_rows(q_ptr, q_out_ptr, row, stride_qt, stride_qh, stride_qot, stride_qoh, num_q_heads, cos1, sin1, cos2,
               sin2, Q_HEADS, HALF)
    _rope_rows(k_ptr, k_ptr, row, stride_kt, stride_kh, stride_kt, stride_kh, num_k_heads, cos1, sin1, cos2, sin2,
               K_HEADS, HALF)


def rope_inplace(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, query_out: torch.Tensor | None = None) -> None:
    """query [T, Hq, D], key [T, Hk, D] (strided views allowed, head_dim contiguous), positions [T],
    cos/sin [max_positions, D] float32 (rotate-half layout). Rotates both in place, or the query
    into query_out ([T, Hq, D], head_dim contiguous; query is then left as it was)."""
    check(query.dim() == 3 and key.dim() == 3 and query.shape[0] == key.shape[0] == positions.shape[0],
          "query [T, Hq, D], key [T, Hk, D] and positions [T] must agree on T")
    check(query.stride(-1) == 1 and key.stride(-1) == 1, "head_dim must be contiguous")
    check(cos.dtype == torch.float32 and cos.shape == sin.shape and cos.stride(-1) == 1, "cos/sin: float32 tables")
    num_tokens, num_q_heads, head_dim = query.shape
    check(key.shape[2] == head_dim and cos.shape[1] == head_dim and head_dim % 2 == 0, "head_dim mismatch")
    half = head_dim // 2
    check(half == next_power_of_2(half), f"head_dim / 2 must be a power of 2, got {half}")
    if query_out is None:
        query_out = query
    check(query_out.shape == query.shape and query_out.dtype == query.dtype and query_out.stride(-1) == 1,
          "query_out must be shaped like query, contiguous in head_dim")
    if num_tokens:
        _rope_kernel[(num_tokens,)](
            query, query_out, key, positions, cos, sin, query.stride(0), query.stride(1), query_out.stride(0),
            query_out.stride(1), key.stride(0), key.stride(1), cos.stride(0), num_q_heads, key.shape[1],
            Q_HEADS=next_power_of_2(num_q_heads),
            K_HEADS=next_power_of_2(key.shape[1]), HALF=half, num_warps=4,
        )
