"""A dense call's output (ops/prefix_attention.py, `_dense_output`) written to its rows: the
library kernel's [batch, rows, heads, head_dim] output, times the V scale of an FP8 cache, into
the step's output rows or its float32 partial slots, with the base-2 log-sum-exps beside them.

The output of a batch of causal squares is a strided view (each square's padded rows cut off),
which PyTorch copies element by element: on an H200 such copies took 7.9 ms of each 283 ms step
of uniform 5000/500 (benchmarks/profile_engine.py). This kernel moves whole rows, one launch per
call for the output and its log-sum-exps. On the H200, one layer's output of 3 squares of 5,000
rows (padded to 5,120) took 0.066 ms against PyTorch's 0.142 into the output, 0.098 against
0.210 into partial slots with the log-sum-exps; one square's contiguous output PyTorch copies
faster (0.025 against 0.029 ms), so that case stays a plain copy. `store_dense_output_reference`
is the PyTorch chain, with the same rounding: the V scale applies in the output's dtype, then the
value is converted to the destination's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchllm.attention_plan.checks import check, next_power_of_2

LOG2_E = 1.4426950408889634
ROWS_PER_PROGRAM = 2  # rows of heads x head_dim values each (4,096 for Llama-3.1-8B)


@triton.jit
def _store_dense_output_kernel(
    o_ptr,  # [batch, rows, heads, head_dim], head_dim contiguous
    lse_ptr,  # [batch, rows, heads] float32 (read only with HAS_LSE)
    out_ptr,  # [batch * rows, heads, head_dim], head_dim contiguous
    lse_out_ptr,  # [batch * rows, heads] float32, heads contiguous: base 2 (HAS_LSE)
    num_rows, total_rows, v_scale, lse_scale,  # lse_scale: log2(e) for a natural log, 1.0 for base 2
    stride_ob, stride_or, stride_oh, stride_lb, stride_lr, stride_lh, stride_out_t, stride_out_h, stride_lse_t,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_COLS: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr, SCALED: tl.constexpr, HAS_LSE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = rows < total_rows
    entry = (rows // num_rows).to(tl.int64)
    row = (rows % num_rows).to(tl.int64)
    cols = tl.arange(0, BLOCK_COLS)
    head = cols // HEAD_DIM
    dim = cols % HEAD_DIM
    mask = valid[:, None] & (head < NUM_HEADS)[None, :]
    src = (entry * stride_ob + row * stride_or)[:, None] + (head * stride_oh + dim)[None, :]
    x = tl.load(o_ptr + src, mask=mask, other=0.0)
    if SCALED:  # o * v_scale in o's dtype, as PyTorch rounds it
        x = (x.to(tl.float32) * v_scale).to(o_ptr.dtype.element_ty)
    dst = rows.to(tl.int64)[:, None] * stride_out_t + (head * stride_out_h + dim)[None, :]
    tl.store(out_ptr + dst, x.to(out_ptr.dtype.element_ty), mask=mask)
    if HAS_LSE:
        heads = tl.arange(0, BLOCK_H)
        lse_mask = valid[:, None] & (heads < NUM_HEADS)[None, :]
        lse = tl.load(lse_ptr + (entry * stride_lb + row * stride_lr)[:, None] + heads[None, :] * stride_lh,
                      mask=lse_mask, other=0.0)
        tl.store(lse_out_ptr + rows.to(tl.int64)[:, None] * stride_lse_t + heads[None, :], lse * lse_scale,
                 mask=lse_mask)


def store_dense_output_reference(o: torch.Tensor, lse: torch.Tensor | None, out_rows: torch.Tensor,
                                 lse_rows: torch.Tensor | None, v_scale: float = 1.0,
                                 lse_scale: float = LOG2_E) -> None:
    """store_dense_output by PyTorch ops (the kernel's reference)."""
    if v_scale != 1.0:
        o = o * v_scale
    out_rows.view(o.shape).copy_(o)
    if lse_rows is not None:
        torch.mul(lse, lse_scale, out=lse_rows.view(lse.shape))


def store_dense_output(o: torch.Tensor, lse: torch.Tensor | None, out_rows: torch.Tensor,
                       lse_rows: torch.Tensor | None, v_scale: float = 1.0, lse_scale: float = LOG2_E) -> None:
    """o [batch, rows, heads, head_dim] (any strides, head_dim contiguous) times v_scale into
    out_rows [batch * rows, heads, head_dim]; with lse_rows, lse [batch, rows, heads] times
    lse_scale into lse_rows [batch * rows, heads] float32 (log2(e): a natural log to base 2; 1.0:
    a log-sum-exp in base 2 already)."""
    check(o.dim() == 4 and out_rows.shape == (o.shape[0] * o.shape[1], *o.shape[2:]),
          f"out_rows must be [batch * rows, heads, head_dim] for an output {tuple(o.shape)}, got "
          f"{tuple(out_rows.shape)}")
    check((lse is None) == (lse_rows is None), "lse and lse_rows go together")
    if lse is not None and lse_rows is not None:
        check(lse.shape == o.shape[:3] and lse_rows.shape == out_rows.shape[:2] and lse_rows.dtype == torch.float32,
              f"lse must be [batch, rows, heads] and lse_rows [batch * rows, heads] float32, got "
              f"{tuple(lse.shape)} / {tuple(lse_rows.shape)} {lse_rows.dtype}")
    layout_ok = (o.stride(3) == 1 and out_rows.stride(2) == 1
                 and (lse_rows is None or lse_rows.stride(1) == 1))
    plain_copy = lse is None and v_scale == 1.0 and o.is_contiguous()  # PyTorch's vectorized copy
    if plain_copy or not layout_ok:
        store_dense_output_reference(o, lse, out_rows, lse_rows, v_scale, lse_scale)
        return
    batch, num_rows, num_heads, head_dim = o.shape
    total_rows = batch * num_rows
    if total_rows == 0:
        return
    has_lse = lse is not None and lse_rows is not None
    if has_lse:
        lse_src, lse_dst, lse_strides, lse_row_stride = lse, lse_rows, lse.stride(), lse_rows.stride(0)
    else:  # never read without HAS_LSE
        lse_src, lse_dst, lse_strides, lse_row_stride = o, out_rows, (0, 0, 0), 0
    grid = (triton.cdiv(total_rows, ROWS_PER_PROGRAM),)
    _store_dense_output_kernel[grid](
        o, lse_src, out_rows, lse_dst, num_rows, total_rows, float(v_scale), float(lse_scale),
        o.stride(0), o.stride(1), o.stride(2), *lse_strides, out_rows.stride(0), out_rows.stride(1), lse_row_stride,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_COLS=next_power_of_2(num_heads * head_dim),
        BLOCK_H=next_power_of_2(num_heads), BLOCK_R=ROWS_PER_PROGRAM, SCALED=v_scale != 1.0, HAS_LSE=has_lse,
        num_warps=8)
