"""store_dense_output (Triton) against store_dense_output_reference: a dense call's output and
log-sum-exps in their rows, exactly."""

import pytest
import torch

from batchllm.ops.dense_store import store_dense_output, store_dense_output_reference


def _output(batch, padded, num_rows, heads, head_dim, dtype, device, head_major):
    """A library kernel's output cut to num_rows of its padded rows: a strided view."""
    generator = torch.Generator().manual_seed(batch * 100 + num_rows)
    shape = (batch, heads, padded, head_dim) if head_major else (batch, padded, heads, head_dim)
    o = (torch.randn(shape, generator=generator) * 4).to(device=device, dtype=dtype)
    if head_major:
        o = o.transpose(1, 2)
    lse = torch.randn(batch, heads, padded, generator=generator).to(device).transpose(1, 2)
    return o[:, :num_rows], lse[:, :num_rows]


@pytest.mark.parametrize("batch,padded,num_rows", [(1, 12, 12), (1, 16, 11), (3, 8, 7), (2, 4, 1)])
@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                             (torch.float16, torch.float32)])
@pytest.mark.parametrize("v_scale", [1.0, 0.37])
@pytest.mark.parametrize("head_major", [False, True])
def test_store_matches_reference(device, batch, padded, num_rows, dtype, out_dtype, v_scale, head_major):
    heads, head_dim = 3, 32
    o, lse = _output(batch, padded, num_rows, heads, head_dim, dtype, device, head_major)
    total = batch * num_rows
    # rows inside a bigger buffer, as a step's output rows or partial slots
    out = torch.full((total + 5, heads, head_dim), -7.0, dtype=out_dtype, device=device)
    lse_out = torch.full((total + 5, heads), -7.0, dtype=torch.float32, device=device)
    ref, ref_lse = out.clone(), lse_out.clone()
    with_lse = out_dtype == torch.float32  # partial slots carry their log-sum-exps
    store_dense_output(o, lse if with_lse else None, out[2:2 + total], lse_out[2:2 + total] if with_lse else None,
                       v_scale)
    store_dense_output_reference(o, lse if with_lse else None, ref[2:2 + total],
                                 ref_lse[2:2 + total] if with_lse else None, v_scale)
    assert torch.equal(out, ref) and torch.equal(lse_out, ref_lse)
    assert (out[:2] == -7).all() and (out[2 + total:] == -7).all()  # nothing outside its rows


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bfloat16 rounding is checked on the GPU")
def test_store_bfloat16_matches_reference(device):
    o, lse = _output(3, 5120, 5000, 32, 128, torch.bfloat16, device, head_major=True)
    out, ref = (torch.zeros(15000, 32, 128, dtype=torch.bfloat16, device=device) for _ in range(2))
    store_dense_output(o, None, out, None, 0.5)
    store_dense_output_reference(o, None, ref, None, 0.5)
    assert torch.equal(out, ref)


def test_store_rejects_bad_shapes(device):
    o, lse = _output(2, 4, 3, 2, 16, torch.float32, device, head_major=False)
    with pytest.raises(ValueError, match="out_rows"):
        store_dense_output(o, None, torch.zeros(5, 2, 16, device=device), None)
    with pytest.raises(ValueError, match="go together"):
        store_dense_output(o, lse, torch.zeros(6, 2, 16, device=device), None)


@pytest.mark.parametrize("head_major", [False, True])
def test_store_takes_a_base_2_log_sum_exp_as_it_is(device, head_major):
    """lse_scale=1.0 (a kernel whose log-sum-exp is in base 2 already): copied unscaled."""
    o, lse = _output(2, 8, 7, 3, 32, torch.float16, device, head_major)
    out, ref = (torch.zeros(14, 3, 32, dtype=torch.float32, device=device) for _ in range(2))
    lse_out, ref_lse = (torch.zeros(14, 3, dtype=torch.float32, device=device) for _ in range(2))
    store_dense_output(o, lse, out, lse_out, lse_scale=1.0)
    store_dense_output_reference(o, lse, ref, ref_lse, lse_scale=1.0)
    assert torch.equal(out, ref) and torch.equal(lse_out, ref_lse)
    assert torch.equal(lse_out, lse.reshape(14, 3))
