"""FP8 (e4m3) activations and GEMMs of the decoder's linear layers.

A linear layer's input is quantized per token (one float32 scale per row: amax / 448) or with a
static per-tensor scale from a checkpoint; its weight per output channel. The GEMM is
`torch._scaled_mm` (cuBLASLt), which applies both scales in its epilogue and writes the model
dtype. The per-token quantization is fused into the kernels that produce the activation (RMSNorm
and SwiGLU in fused_layers.py); fp8_kernels.quantize_rows is the stand-alone kernel for the
attention output. This module is torch-only (no Triton import).

Rounding is the same in the kernels and in `quantize_rows_reference`: inv = 448 / amax and
scale = amax / 448 in IEEE float32 (div_rn), q = clamp(x * inv, -448, 448) rounded to nearest
even, first to float16 and then to e4m3: both sides take the same two rounding steps, so on a
GPU the kernels equal the reference bit for bit (tests/test_ops_fp8_gpu.py). The float16 step
moves a value only where the two roundings tie, far below e4m3's own error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
MIN_AMAX = 1e-12  # an all-zero row gets this amax (scale ~2e-15) instead of dividing by zero


class QuantizedActivation(NamedTuple):
    """A linear layer's input in e4m3 with its scales (dequantized = values * scales)."""

    values: torch.Tensor  # [T, K] float8_e4m3fn
    scales: torch.Tensor  # [T, 1] float32

    @property
    def shape(self) -> torch.Size:
        return self.values.shape


def quantize_rows_reference(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> QuantizedActivation:
    """x [T, K] -> per-row e4m3 (static_scale: one float32 scale for every row)."""
    x32 = x.float()
    # Tensor-by-tensor divisions: CUDA torch turns a division by a Python number into a
    # multiplication by its reciprocal, which is not the correctly rounded quotient.
    if static_scale is None:
        amax = x32.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX)
        fp8_max = torch.full_like(amax, FP8_MAX)
        inv, scales = fp8_max / amax, amax / fp8_max
    else:
        scales = static_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
        inv = torch.ones_like(scales) / scales
    values = (x32 * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float16).to(FP8_DTYPE)
    return QuantizedActivation(values, scales)


def quantize_weight_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (any float dtype) -> (e4m3 [N, K], float32 per-output-channel scales [N])."""
    quantized = quantize_rows_reference(weight)
    return quantized.values, quantized.scales.reshape(-1)


def fp8_linear(x: QuantizedActivation, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """x [T, K] e4m3 with row scales, weight [N, K] e4m3 with scales [N] -> [T, N] in out_dtype:
    (x * x.scales) @ (weight * weight_scale).T + bias."""
    if x.values.shape[0] == 0:
        out = torch.empty((0, weight.shape[0]), dtype=out_dtype, device=weight.device)
    else:
        # weight.t() is the column-major [K, N] operand cuBLASLt wants; the scales are applied in
        # the GEMM's epilogue (row-wise: [T, 1] and [1, N]). Fast accumulation, as vLLM's and
        # TensorRT-LLM's Hopper FP8 GEMMs run: on the H200 uniform 2048/128 ran 5-10% faster end to end
        # with it, and its relative error on Llama-3.1-8B's layer shapes was 0.0021-0.0033 (0.0017 off).
        out = torch._scaled_mm(x.values, weight.t(), scale_a=x.scales, scale_b=weight_scale.view(1, -1),
                               out_dtype=out_dtype, use_fast_accum=True)
    return out if bias is None else out + bias


SKINNY_MAX_ROWS = 128  # the most rows the skinny GEMM (ops/fp8_skinny.py) takes
SKINNY_MIN_DIM = 4096  # the narrowest N and K it was measured on; narrower layers stay on cuBLASLt


@dataclass(frozen=True)
class SkinnyConfig:
    """Tiles of one skinny GEMM call: block_n output channels a program, K in block_k steps over
    num_stages buffers, split over split_k programs."""

    block_n: int
    block_k: int
    split_k: int
    num_stages: int
    num_warps: int


def skinny_config(num_rows: int, n: int, k: int, num_sms: int) -> SkinnyConfig | None:
    """The skinny GEMM's tiles for x [num_rows, k] @ W[n, k].T, or None where cuBLASLt is faster.

    Chosen by a sweep on the H200 (132 SMs) over Llama-3.1-8B's and 70B's layer shapes at 16, 64 and
    128 rows (BENCHMARKS.md, "FP8 GEMMs of small decode steps"): 64 channels a program when they fit
    one wave of programs, K split in two where that wave would fill half the SMs or fewer and K is
    8192 or more; 128 channels and 8 warps for layers of three waves or more, at up to 64 rows
    only. Elsewhere (between one and three waves, or many waves at more than 64 rows) cuBLASLt was
    as fast or faster; layers narrower than the sweep's (N or K under SKINNY_MIN_DIM) are left to
    it too.
    """
    if not 0 < num_rows <= SKINNY_MAX_ROWS or n < SKINNY_MIN_DIM or k < SKINNY_MIN_DIM:
        return None
    if n // 64 <= num_sms:
        split_k = 2 if n // 64 <= num_sms // 2 and k >= 8192 else 1
        config = SkinnyConfig(block_n=64, block_k=256, split_k=split_k, num_stages=4, num_warps=4)
    elif n // 64 >= 3 * num_sms and num_rows <= 64:
        config = SkinnyConfig(block_n=128, block_k=128, split_k=1, num_stages=3, num_warps=8)
    else:
        return None
    fits = n % config.block_n == 0 and k % (config.block_k * config.split_k) == 0
    return config if fits else None


class SkinnyWorkspace:
    """The split-K partials and tile counters of the skinny GEMMs of one model, one pair per output
    width, sized for SKINNY_MAX_ROWS rows and allocated once, on the first call that needs them (a
    graph's warm-up run precedes its capture), so that every captured graph keeps pointing at live
    buffers. The counters return to zero at the end of every call, so calls and graph replays in
    stream order share them."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, int, int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, n: int, config: SkinnyConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 partials [split_k, n, SKINNY_MAX_ROWS], int32 counters [n / block_n])."""
        key = (n, config.split_k, config.block_n, device)
        if key not in self._buffers:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the skinny GEMM's workspace must exist before a CUDA graph is captured: "
                                   "run the step once outside the capture first")
            partials = torch.empty((config.split_k, n, SKINNY_MAX_ROWS), dtype=torch.float32, device=device)
            counters = torch.zeros(n // config.block_n, dtype=torch.int32, device=device)
            self._buffers[key] = (partials, counters)
        return self._buffers[key]
