"""quantize_query (Triton) against quantize_query_reference: query rows in e4m3 with a scale per
head, byte for byte."""

import pytest
import torch

from batchllm.ops.query_fp8 import FP8_E4M3_MAX, quantize_query, quantize_query_reference


def _query(num_tokens, heads, head_dim, dtype, device, seed=0):
    """A query as the model hands it: a view into the rows of its QKV projection."""
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (heads + 2) * head_dim, generator=generator) * 3
    qkv[:, head_dim:2 * head_dim] *= 1e-3  # a head of small values keeps its own scale
    qkv[:, 2 * head_dim:3 * head_dim] = 0.0  # an all-zero head
    return qkv.to(device=device, dtype=dtype)[:, :heads * head_dim].view(num_tokens, heads, head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [[5, 3, 99, 0, 50] + list(range(60, 90)), list(range(100)), [7]])
def test_quantize_query_matches_reference(device, dtype, rows):
    query = _query(100, 5, 64, dtype, device)
    index = torch.tensor(rows, dtype=torch.int32, device=device)
    q8, scale = quantize_query(query, index)
    ref_q8, ref_scale = quantize_query_reference(query, index)
    assert q8.shape == (len(rows), 5, 64) and q8.dtype == torch.float8_e4m3fn and q8.is_contiguous()
    assert torch.equal(q8.view(torch.uint8), ref_q8.view(torch.uint8))
    assert torch.equal(scale, ref_scale)
    # each head's largest value maps to 448, and dequantized values are within half an e4m3 step
    picked = query.index_select(0, index.long()).float()
    top = q8.float().abs().amax(dim=(0, 2))
    assert top[0] == FP8_E4M3_MAX and top[1] == FP8_E4M3_MAX and top[2] == 0.0
    assert (q8.float() * scale[None, :, None] - picked).abs().le(picked.abs() / 16 + scale[None, :, None] / 512).all()


def test_quantize_query_divides_as_ieee(device):
    """The scale's inverse is 448 / amax rounded once (the kernel's div_rn): for this amax,
    448 * (1 / amax) is one float32 step away, which turns the small value into another e4m3 byte."""
    amax, small = 2.745331287384033, 0.0002513426006771624
    inverse = torch.tensor([FP8_E4M3_MAX]) / torch.tensor([amax])
    assert (torch.tensor([amax]).reciprocal() * FP8_E4M3_MAX) != inverse
    query = torch.zeros(2, 1, 16, device=device)
    query[0, 0, 0], query[1, 0, 3] = amax, small
    index = torch.arange(2, dtype=torch.int32, device=device)
    q8, _ = quantize_query(query, index)
    expected = (torch.tensor(small) * inverse).to(torch.float8_e4m3fn).view(torch.uint8)
    assert q8.view(torch.uint8)[1, 0, 3].cpu() == expected
    assert torch.equal(q8.view(torch.uint8), quantize_query_reference(query, index)[0].view(torch.uint8))


def test_quantize_query_keeps_the_sign_of_zero(device):
    """A negative value that rounds to zero is e4m3's -0 (byte 0x80), as a conversion gives it."""
    query = torch.zeros(2, 1, 16, device=device)
    query[0, 0, 0], query[1, 0, 1], query[1, 0, 2], query[1, 0, 3] = 1.0, -1e-7, -0.0, 1e-7
    index = torch.arange(2, dtype=torch.int32, device=device)
    q8 = quantize_query(query, index)[0].view(torch.uint8)
    assert q8[1, 0, :5].tolist() == [0, 0x80, 0x80, 0, 0]
    assert torch.equal(q8, quantize_query_reference(query, index)[0].view(torch.uint8))


def test_quantize_query_of_no_rows(device):
    q8, scale = quantize_query(_query(10, 3, 32, torch.float32, device), torch.zeros(0, dtype=torch.int32,
                                                                                      device=device))
    assert q8.shape == (0, 3, 32) and scale.shape == (3,) and (scale > 0).all()


def test_quantize_query_rejects_bad_inputs(device):
    query = _query(10, 3, 32, torch.float32, device)
    with pytest.raises(ValueError, match="rows must be"):
        quantize_query(query, torch.zeros(2, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="head_dim contiguous"):
        quantize_query(query.transpose(1, 2), torch.zeros(2, dtype=torch.int32, device=device))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bfloat16 is checked on the GPU")
def test_quantize_query_bfloat16_matches_reference(device):
    query = _query(16384, 32, 128, torch.bfloat16, device)
    index = torch.arange(300, 16000, dtype=torch.int32, device=device)
    q8, scale = quantize_query(query, index)
    ref_q8, ref_scale = quantize_query_reference(query, index)
    assert torch.equal(q8.view(torch.uint8), ref_q8.view(torch.uint8)) and torch.equal(scale, ref_scale)
