"""Fused layer kernels (RMSNorm, SiLU-and-mul, RoPE) against their PyTorch references."""

import pytest
import torch

from batchllm.ops.fused_layers import rms_norm, rope_inplace, silu_and_mul
from op_references import rms_norm_reference, rope_reference, silu_and_mul_reference


def _dtypes(device):
    return [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])


@pytest.mark.parametrize("hidden", [64, 96])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(device, hidden, with_residual):
    for dtype in _dtypes(device):
        gen = torch.Generator().manual_seed(hidden)
        x = torch.randn(5, hidden, generator=gen).to(device, dtype)
        weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device, dtype)
        residual = torch.randn(5, hidden, generator=gen).to(device, dtype) if with_residual else None
        out, new_residual = rms_norm(x, weight, 1e-5, residual)
        ref_out, ref_residual = rms_norm_reference(x, weight, 1e-5, residual)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)
        torch.testing.assert_close(new_residual, ref_residual, atol=0, rtol=0)


def test_silu_and_mul(device):
    for dtype in _dtypes(device):
        gate_up = torch.randn(3, 2 * 1100, generator=torch.Generator().manual_seed(1)).to(device, dtype)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(silu_and_mul(gate_up), silu_and_mul_reference(gate_up), atol=tol, rtol=tol)


@pytest.mark.parametrize("num_q_heads,num_k_heads,head_dim", [(9, 3, 64), (4, 4, 32)])
def test_rope_inplace_on_strided_qkv_views(device, num_q_heads, num_k_heads, head_dim):
    gen = torch.Generator().manual_seed(2)
    positions = torch.tensor([0, 5, 17, 3], device=device)
    angles = torch.outer(torch.arange(32).float(), 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)))
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    for dtype in _dtypes(device):
        q_size, kv_size = num_q_heads * head_dim, num_k_heads * head_dim
        qkv = torch.randn(4, q_size + 2 * kv_size, generator=gen).to(device, dtype)
        q = qkv[:, :q_size].view(4, num_q_heads, head_dim)
        k = qkv[:, q_size:q_size + kv_size].view(4, num_k_heads, head_dim)
        expected_q, expected_k = rope_reference(q, positions, cos, sin), rope_reference(k, positions, cos, sin)
        v_before = qkv[:, q_size + kv_size:].clone()
        rope_inplace(q, k, positions, cos, sin)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(q, expected_q, atol=tol, rtol=tol)
        torch.testing.assert_close(k, expected_k, atol=tol, rtol=tol)
        assert torch.equal(qkv[:, q_size + kv_size:], v_before)  # values untouched


def test_rope_reference_matches_the_model_rope():
    from batchllm.models.presets import parse_random_spec
    from batchllm.models.rope import RotaryEmbedding, apply_rope

    config = parse_random_spec("random:tiny").config
    rotary = RotaryEmbedding(config)
    positions = torch.tensor([0, 7, 63])
    x = torch.randn(3, config.num_heads, config.head_dim)
    cos, sin = rotary.cos_sin(positions)
    torch.testing.assert_close(rope_reference(x, positions, rotary.cos, rotary.sin), apply_rope(x, cos, sin))


def test_rms_norm_updates_the_residual_in_place(device):
    """residual_out=residual: the residual stream is overwritten with x + residual, row by row, and
    the normed rows are those of the out-of-place call."""
    for dtype in _dtypes(device):
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(6, 96, generator=gen).to(device, dtype)
        weight = (1 + 0.1 * torch.randn(96, generator=gen)).to(device, dtype)
        residual = torch.randn(6, 96, generator=gen).to(device, dtype)
        expected_out, expected_residual = rms_norm(x, weight, 1e-5, residual.clone())
        out, new_residual = rms_norm(x, weight, 1e-5, residual, residual_out=residual)
        assert new_residual is residual
        assert torch.equal(residual, expected_residual) and torch.equal(out, expected_out)


def test_rope_writes_the_query_into_a_buffer_of_its_own(device):
    """query_out: the rotated query lands there (the query view is left as it was), the key is
    rotated in place, both as rope_inplace would."""
    positions = torch.tensor([0, 5, 17], device=device)
    angles = torch.outer(torch.arange(32).float(), 1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32)))
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    for dtype in _dtypes(device):
        qkv = torch.randn(3, 6 * 32, generator=torch.Generator().manual_seed(4)).to(device, dtype)
        q, k = qkv[:, :4 * 32].view(3, 4, 32), qkv[:, 4 * 32:5 * 32].view(3, 1, 32)
        expected = qkv.clone()
        rope_inplace(expected[:, :4 * 32].view(3, 4, 32), expected[:, 4 * 32:5 * 32].view(3, 1, 32), positions, cos, sin)
        q_before = q.clone()
        query_out = torch.full((3, 4, 32), 7.0, device=device, dtype=dtype)
        rope_inplace(q, k, positions, cos, sin, query_out)
        assert torch.equal(query_out, expected[:, :4 * 32].view(3, 4, 32))
        assert torch.equal(q, q_before)
        assert torch.equal(qkv[:, 4 * 32:], expected[:, 4 * 32:])
