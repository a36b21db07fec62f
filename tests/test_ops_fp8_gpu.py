"""FP8 kernels and the FP8 engine on the GPU: the fused quantization equals the reference rule bit
for bit, and an FP8 model runs through the engine (eager, CUDA graphs, FP8 KV cache)."""

import pytest
import torch
from graph_helpers import capture

from batchllm.ops.fp8 import QuantizedActivation, fp8_linear, quantize_rows_reference, quantize_weight_rows

pytestmark = pytest.mark.gpu

FP8_CAPABLE = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
needs_fp8 = pytest.mark.skipif(not FP8_CAPABLE, reason="FP8 needs a GPU of compute capability 8.9+")


def _same(a: QuantizedActivation, b: QuantizedActivation) -> None:
    assert torch.equal(a.scales, b.scales), (a.scales != b.scales).sum().item()
    differ = a.values.view(torch.uint8) != b.values.view(torch.uint8)
    assert not differ.any(), (f"{differ.sum().item()} of {differ.numel()} differ, e.g. "
                              f"{a.values[differ][:4].float().tolist()} vs {b.values[differ][:4].float().tolist()}")


@needs_fp8
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_fp8_equals_quantized_rms_norm(static, with_residual):
    from batchllm.ops.fused_layers import rms_norm

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(37, 4096, generator=gen, device="cuda").to(torch.bfloat16) * 3
    weight = (1 + 0.1 * torch.randn(4096, generator=gen, device="cuda")).to(torch.bfloat16)
    residual = torch.randn(x.shape, generator=gen, device="cuda").to(torch.bfloat16) if with_residual else None
    scale = torch.tensor(0.02, device="cuda") if static else None
    expected, expected_residual = rms_norm(x, weight, 1e-5, residual)
    got, got_residual = rms_norm(x, weight, 1e-5, residual, fp8=True, static_scale=scale)
    _same(got, quantize_rows_reference(expected, scale))
    assert torch.equal(got_residual, expected_residual)


@needs_fp8
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("intermediate", [14336, 1100, 20000])
def test_silu_and_mul_fp8_equals_quantized_silu_and_mul(static, intermediate):
    from batchllm.ops.fused_layers import silu_and_mul

    gen = torch.Generator(device="cuda").manual_seed(1)
    gate_up = torch.randn(53, 2 * intermediate, generator=gen, device="cuda").to(torch.bfloat16)
    scale = torch.tensor(0.01, device="cuda") if static else None
    _same(silu_and_mul(gate_up, fp8=True, static_scale=scale), quantize_rows_reference(silu_and_mul(gate_up), scale))


@needs_fp8
@pytest.mark.parametrize("static", [False, True])
def test_quantize_rows_kernel_equals_reference(static):
    from batchllm.ops.fp8_kernels import quantize_rows

    x = torch.randn(300, 4096, device="cuda").to(torch.bfloat16) * 5
    x[7] = 0  # an all-zero row
    scale = torch.tensor(0.05, device="cuda") if static else None
    _same(quantize_rows(x, scale), quantize_rows_reference(x, scale))
    assert quantize_rows(x[:0]).values.shape == (0, 4096)


@needs_fp8
@pytest.mark.parametrize("num_rows", [1, 13, 2048])
def test_fp8_linear_on_gpu_equals_dequantized_matmul(num_rows):
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(num_rows, 4096, generator=gen, device="cuda").to(torch.bfloat16)
    weight = (0.02 * torch.randn(6144, 4096, generator=gen, device="cuda")).to(torch.bfloat16)
    qx = quantize_rows_reference(x)
    qw, w_scale = quantize_weight_rows(weight)
    out = fp8_linear(qx, qw, w_scale, None, torch.bfloat16)
    expected = (qx.values.float() * qx.scales) @ (qw.float() * w_scale[:, None]).T
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


def _relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.float() - expected).abs().max() / expected.abs().max()).item()


@needs_fp8
@pytest.mark.parametrize("num_rows", [1, 16, 80, 128])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (28672, 4096)])
def test_fp8_linear_of_few_rows_is_as_accurate_as_cublas(num_rows, n, k):
    """Fp8Linear's skinny GEMM (one wave of programs; K split in two for the down projection's
    shape; 128-channel tiles for gate_up's at up to 64 rows) against the dequantized product, beside
    cuBLASLt's fast accumulation on the same operands, and the same bytes on a second call."""
    from batchllm.models.fp8_linear import Fp8Linear

    gen = torch.Generator(device="cuda").manual_seed(3)
    layer = Fp8Linear(k, n, False, torch.bfloat16).cuda()
    layer.load_rows_((0.02 * torch.randn(n, k, generator=gen, device="cuda")).to(torch.bfloat16), 0)
    x = quantize_rows_reference(torch.randn(num_rows, k, generator=gen, device="cuda").to(torch.bfloat16))
    expected = (x.values.float() * x.scales) @ layer.dequantized_weight().T
    cublas = fp8_linear(x, layer.weight, layer.weight_scale, None, torch.bfloat16)
    out = layer(x)
    expect_skinny = not (n == 28672 and num_rows > 64)
    assert (layer.skinny_config(num_rows) is not None) == expect_skinny
    assert _relative_error(out, expected) <= 1.5 * _relative_error(cublas, expected) + 2e-3
    assert torch.equal(layer(QuantizedActivation(x.values.clone(), x.scales.clone())), out)


@needs_fp8
def test_skinny_gemm_replays_in_a_cuda_graph():
    """A graph captured after one warm-up call (which allocates the split-K workspace) replays new
    inputs into the eager result, call after call (the tile counters return to zero)."""
    from batchllm.models.fp8_linear import Fp8Linear

    gen = torch.Generator(device="cuda").manual_seed(4)
    layer = Fp8Linear(14336, 4096, False, torch.bfloat16).cuda()
    layer.load_rows_((0.02 * torch.randn(4096, 14336, generator=gen, device="cuda")).to(torch.bfloat16), 0)
    assert layer.skinny_config(48).split_k == 2
    static = quantize_rows_reference(torch.randn(48, 14336, generator=gen, device="cuda"))
    graph, out = capture(lambda: layer(static))
    for seed in range(3):
        fresh = quantize_rows_reference(torch.randn(48, 14336, generator=gen, device="cuda") * (seed + 1))
        static.values.copy_(fresh.values)
        static.scales.copy_(fresh.scales)
        graph.replay()
        assert torch.equal(out, layer(fresh))


@needs_fp8
def test_fused_fp8_model_equals_its_unfused_path():
    """The fused kernels (quantization inside RMSNorm and SwiGLU) give the logits of the unfused
    path (bf16 activations quantized by the reference rule). The two paths round a rare activation
    one e4m3 step apart, and with the GEMMs' fast accumulation every output of a product that
    reads it rounds anew: the logits (largest about 5.6, standard deviation 1.28 in float32 on
    CPU) were 0.047 apart at most on the H200, so the tolerance is 2% of the largest logit, far
    below what a wrong scale or a wrong row would move."""
    from batchllm.models.loader import load_model
    from model_helpers import run_flat

    loaded = load_model("random:llama-3.1-8b?num_layers=2&vocab_size=4096", device="cuda", quantization="fp8")
    tokens = [list(range(7, 70)), list(range(100, 117))]
    loaded.model.fused_kernels = False
    unfused = run_flat(loaded, tokens)
    loaded.model.fused_kernels = True
    fused = run_flat(loaded, tokens)
    for a, b in zip(fused, unfused):
        torch.testing.assert_close(a, b, atol=2e-2 * b.abs().max().item(), rtol=2e-2)


@needs_fp8
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_fp8_engine_graphs_equal_eager(kv_cache_dtype):
    """An FP8 model (and cache) runs through the engine; graph replays give the eager tokens.
    (How close FP8 stays to bf16 is measured on a real model: tests/test_fp8_accuracy_gpu.py.)"""
    from batchllm import LLM, SamplingParams
    from batchllm.engine.run_options import RunOptions

    prompts = [{"prompt_token_ids": [1 + (i * 7 + j) % 4000 for j in range(20 + 9 * i)]} for i in range(12)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(model="random:llama-3.1-8b?num_layers=2&vocab_size=4096", quantization="fp8",
              kv_cache_dtype=kv_cache_dtype, kv_cache_tokens=16384)
    assert llm.engine.kv_cache.k.dtype == (torch.float8_e4m3fn if kv_cache_dtype == "fp8" else torch.bfloat16)
    graphed = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    counts = llm.engine.runner.graph_counts()
    assert counts["graph_replays"] > 0 and counts["piecewise_steps"] > 0 and counts["eager_steps"] == 0
    eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False,
                                                           options=RunOptions(cuda_graphs=False))]
    same_first = sum(g[0] == e[0] for g, e in zip(graphed, eager)) / len(prompts)
    assert same_first >= 0.9, same_first
