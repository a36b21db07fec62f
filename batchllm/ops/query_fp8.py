"""A step's query rows in float8_e4m3fn for FP8 attention products (ops/fa3_dense.py): each head
scaled by its own amax over the rows (scale = amax / 448, the largest e4m3 value), gathered into a
compact [num_rows, heads, head_dim] tensor in the order `rows` lists them.

Two launches: the per-head amax (atomic max over row tiles), then the scaled conversion. A scale
per head, not per tensor, keeps a head of small values from losing its mantissa to another head's
outliers; FlashInfer's FA3 FP8 kernel takes one scale per query head. `quantize_query_reference`
is the same by PyTorch ops, the kernels' reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchllm.attention_plan.checks import check

FP8_E4M3_MAX = 448.0
AMAX_FLOOR = 1e-6  # an all-zero head gets this amax: a finite scale, and its values stay zero
ROWS_PER_PROGRAM = 64


@triton.jit
def _round_to_e4m3(y):
    """y (float32, |y| <= 448) rounded to the nearest e4m3 value, ties to even, in float32 arithmetic,
    so that the conversion that follows is exact (Triton's CPU interpreter rounds to fp8 wrongly at
    the top of a binade). The step is 2^(exponent - 3), 2^-9 below the normal range; adding and
    taking off 1.5 * 2^23 rounds y / step to an integer. The magnitude is rounded and y's sign bit put
    back, so that a negative value that rounds to zero is -0, as the conversion gives it."""
    bits = y.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3
    step = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    per_step = ((127 - exponent) << 23).to(tl.float32, bitcast=True)  # 1 / step, exactly
    rounded = ((tl.abs(y) * per_step + 12582912.0) - 12582912.0) * step
    # the sign put back by its bit: Triton's unary minus is 0 - x, which gives +0 for x = +0
    return (rounded.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _load_rows(q_ptr, rows_ptr, num_rows, stride_t, stride_h, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr):
    """This program's BLOCK_R listed rows of its head (program ids: row tile, head): (indices into
    the list, which are valid, values [BLOCK_R, HEAD_DIM], 0 past the list)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = r < num_rows
    row = tl.load(rows_ptr + r, mask=valid, other=0).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    offsets = row[:, None] * stride_t + tl.program_id(1) * stride_h + dims[None, :]
    return r, valid, tl.load(q_ptr + offsets, mask=valid[:, None], other=0.0)


@triton.jit
def _query_amax_kernel(q_ptr, rows_ptr, amax_ptr, num_rows, stride_t, stride_h,
                       HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr):
    _, _, x = _load_rows(q_ptr, rows_ptr, num_rows, stride_t, stride_h, HEAD_DIM, BLOCK_R)
    tl.atomic_max(amax_ptr + tl.program_id(1), tl.max(tl.max(tl.abs(x.to(tl.float32)), axis=1), axis=0))


@triton.jit
def _quantize_query_kernel(q_ptr, rows_ptr, amax_ptr, q8_ptr, num_rows, stride_t, stride_h, amax_floor,
                           NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr):
    r, valid, x = _load_rows(q_ptr, rows_ptr, num_rows, stride_t, stride_h, HEAD_DIM, BLOCK_R)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_DIM)
    amax = tl.maximum(tl.load(amax_ptr + head), amax_floor)
    y = _round_to_e4m3(tl.clamp(x.to(tl.float32) * tl.math.div_rn(448.0, amax), -448.0, 448.0))  # IEEE division
    dst = (r.to(tl.int64) * NUM_HEADS + head)[:, None] * HEAD_DIM + dims[None, :]
    tl.store(q8_ptr + dst, y.to(q8_ptr.dtype.element_ty), mask=valid[:, None])


def quantize_query_reference(query: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_query by PyTorch ops."""
    picked = query.index_select(0, rows.long()).float()
    amax = picked.abs().amax(dim=(0, 2)) if picked.shape[0] else torch.zeros(query.shape[1], device=query.device)
    amax = amax.clamp(min=AMAX_FLOOR)
    # a division of two tensors, IEEE-rounded as the kernel's div_rn (`448 / amax` multiplies by a
    # reciprocal, one rounding more: another scale for a quarter of all amaxes)
    inverse = torch.full_like(amax, FP8_E4M3_MAX) / amax
    scaled = (picked * inverse[None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return scaled.to(torch.float8_e4m3fn), amax / FP8_E4M3_MAX


def quantize_query(query: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """query [num_tokens, heads, head_dim] (head_dim contiguous; a view into the QKV projection is
    fine), rows [n] int32 row indices -> (q8 [n, heads, head_dim] float8_e4m3fn contiguous, with
    q8[i] = query[rows[i]] / scale; scale [heads] float32 = each head's amax over the rows / 448)."""
    check(query.dim() == 3 and query.stride(2) == 1,
          f"query must be [tokens, heads, head_dim] with head_dim contiguous, got {tuple(query.shape)} "
          f"strides {query.stride()}")
    check(rows.dim() == 1 and rows.dtype == torch.int32,
          f"rows must be [n] int32, got {tuple(rows.shape)} {rows.dtype}")
    num_rows = rows.shape[0]
    _, num_heads, head_dim = query.shape
    check(head_dim & (head_dim - 1) == 0, f"head_dim must be a power of 2, got {head_dim}")
    amax = torch.zeros(num_heads, dtype=torch.float32, device=query.device)
    q8 = torch.empty((num_rows, num_heads, head_dim), dtype=torch.float8_e4m3fn, device=query.device)
    if num_rows:
        grid = (triton.cdiv(num_rows, ROWS_PER_PROGRAM), num_heads)
        _query_amax_kernel[grid](query, rows, amax, num_rows, query.stride(0), query.stride(1),
                                 HEAD_DIM=head_dim, BLOCK_R=ROWS_PER_PROGRAM, num_warps=4)
        _quantize_query_kernel[grid](query, rows, amax, q8, num_rows, query.stride(0), query.stride(1), AMAX_FLOOR,
                                     NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_R=ROWS_PER_PROGRAM, num_warps=4)
    return q8, amax.clamp_(min=AMAX_FLOOR).div_(FP8_E4M3_MAX)
