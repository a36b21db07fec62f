"""The skinny FP8 GEMM (ops/fp8_skinny.py) against the dequantized product, with and without split K,
and the rule that picks its tiles (ops/fp8.skinny_config)."""

import pytest
import torch

from batchllm.ops.fp8 import (SKINNY_MAX_ROWS, SkinnyConfig, SkinnyWorkspace, quantize_rows_reference,
                              quantize_weight_rows, skinny_config)
from batchllm.ops.fp8_skinny import skinny_fp8_linear

LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LLAMA_70B = {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672)}
H200_SMS = 132


def _operands(num_rows, n, k, device, seed=0, bias=False):
    generator = torch.Generator().manual_seed(seed)
    x = quantize_rows_reference(torch.randn(num_rows, k, generator=generator) * 2)
    weight, weight_scale = quantize_weight_rows(torch.randn(n, k, generator=generator) * 0.05)
    bias_values = torch.randn(n, generator=generator) if bias else None
    moved = [t.to(device) for t in (x.values, x.scales, weight, weight_scale)]
    x = type(x)(moved[0], moved[1])
    return x, moved[2], moved[3], None if bias_values is None else bias_values.to(device)


def _assert_close(got, expected):
    """Float32 sums on the CPU interpreter; on a GPU, FP8 tensor cores accumulate in reduced
    precision (the accuracy against cuBLASLt is tests/test_ops_fp8_gpu.py's)."""
    if got.is_cuda:
        torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def _reference(x, weight, weight_scale, bias):
    out = (x.values.float() * x.scales.float()) @ (weight.float() * weight_scale[:, None].float()).T
    return out if bias is None else out + bias.float()


@pytest.mark.parametrize(("num_rows", "n", "k", "config", "bias"), [
    (5, 128, 512, SkinnyConfig(64, 128, 1, 2, 4), False),
    (1, 64, 256, SkinnyConfig(64, 128, 1, 2, 4), True),
    (17, 128, 1024, SkinnyConfig(64, 128, 2, 2, 4), True),
    (33, 256, 1024, SkinnyConfig(128, 64, 4, 2, 4), False),
])
def test_skinny_gemm_equals_the_dequantized_product(device, num_rows, n, k, config, bias):
    x, weight, weight_scale, bias_values = _operands(num_rows, n, k, device, bias=bias)
    workspace = SkinnyWorkspace()
    got = skinny_fp8_linear(x, weight, weight_scale, bias_values, torch.float32, config, workspace)
    expected = _reference(x, weight, weight_scale, bias_values)
    assert got.shape == (num_rows, n) and got.dtype == torch.float32
    _assert_close(got, expected)
    if config.split_k > 1:
        partials, counters = workspace.get(n, config, torch.device(device))
        assert partials.shape == (config.split_k, n, SKINNY_MAX_ROWS)
        assert counters.tolist() == [0] * (n // config.block_n)  # back to zero for the next call
    again = skinny_fp8_linear(x, weight, weight_scale, bias_values, torch.float32, config, workspace)
    assert torch.equal(again, got)


def test_skinny_gemm_writes_the_model_dtype(device):
    x, weight, weight_scale, _ = _operands(9, 64, 256, device)
    got = skinny_fp8_linear(x, weight, weight_scale, None, torch.float16, SkinnyConfig(64, 128, 2, 2, 4),
                            SkinnyWorkspace())
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), _reference(x, weight, weight_scale, None), rtol=2e-3, atol=2e-3)


def test_layers_of_one_width_share_the_workspace(device):
    workspace = SkinnyWorkspace()
    config = SkinnyConfig(64, 128, 2, 2, 4)
    first = workspace.get(128, config, torch.device(device))
    assert workspace.get(128, config, torch.device(device))[0] is first[0]
    assert workspace.get(256, config, torch.device(device))[0] is not first[0]
    x, weight, weight_scale, _ = _operands(3, 128, 512, device, seed=1)
    y, w2, s2, _ = _operands(3, 128, 512, device, seed=2)
    a = skinny_fp8_linear(x, weight, weight_scale, None, torch.float32, config, workspace)
    b = skinny_fp8_linear(y, w2, s2, None, torch.float32, config, workspace)
    _assert_close(a, _reference(x, weight, weight_scale, None))
    _assert_close(b, _reference(y, w2, s2, None))


@pytest.mark.parametrize(("num_rows", "n", "k", "message"), [
    (0, 64, 256, "takes 1-128 rows"),
    (129, 64, 256, "takes 1-128 rows"),
    (4, 96, 256, "does not divide"),
    (4, 64, 384, "does not divide"),
])
def test_skinny_gemm_refuses_what_it_cannot_tile(num_rows, n, k, message):
    x, weight, weight_scale, _ = _operands(max(num_rows, 1), n, k, "cpu")
    if num_rows == 0:
        x = type(x)(x.values[:0], x.scales[:0])
    with pytest.raises(ValueError, match=message):
        skinny_fp8_linear(x, weight, weight_scale, None, torch.float32, SkinnyConfig(64, 256, 1, 2, 4),
                          SkinnyWorkspace())


def _tiles(config):
    return None if config is None else (config.block_n, config.block_k, config.split_k, config.num_stages,
                                        config.num_warps)


def test_skinny_config_on_llama_shapes_of_the_h200():
    """The sweep's choices: one wave of 64-channel programs (K split in two for the 8B's down
    projection), 128-channel programs for gate_up at up to 64 rows, cuBLASLt elsewhere."""
    wave, split, wide = (64, 256, 1, 4, 4), (64, 256, 2, 4, 4), (128, 128, 1, 3, 8)
    expected_8b = {16: {"qkv": wave, "o": wave, "gate_up": wide, "down": split},
                   128: {"qkv": wave, "o": wave, "gate_up": None, "down": split}}
    expected_70b = {16: {"qkv": None, "o": wave, "gate_up": wide, "down": wave},
                    128: {"qkv": None, "o": wave, "gate_up": None, "down": wave}}
    for shapes, expected in ((LLAMA_8B, expected_8b), (LLAMA_70B, expected_70b)):
        for num_rows, layers in expected.items():
            got = {name: _tiles(skinny_config(num_rows, n, k, H200_SMS)) for name, (n, k) in shapes.items()}
            assert got == layers, (num_rows, got)


@pytest.mark.parametrize(("num_rows", "n", "k"), [
    (129, 4096, 4096),  # more rows than the kernel takes
    (0, 4096, 4096),
    (8, 960, 576),  # SmolLM2-135M's qkv: K is not a multiple of 256
    (8, 4096 + 32, 4096),  # N is not a multiple of 64
    (8, 2048, 2048),  # narrower than the layers the rule was measured on
    (8, 16384, 2048),
])
def test_skinny_config_leaves_the_rest_to_cublas(num_rows, n, k):
    assert skinny_config(num_rows, n, k, H200_SMS) is None
