"""FP8 (e4m3) KV cache values: the format, its per-cache scales and the quantization rule that
the store kernel and the references share (docs/design.md, "FP8 KV cache").

A stored value q stands for q * scale (one float scale per cache, K and V each their own);
x is stored as e4m3(clamp(x / scale, -448, 448)), rounded to nearest even. float8_e4m3fn has
no infinity: without the clamp a value past the largest finite one would turn into NaN.
"""

from __future__ import annotations

import math

import torch

from batchllm.attention_plan.checks import check
from batchllm.ops.fp8 import FP8_DTYPE, FP8_MAX


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def check_kv_scales(k_scale: float, v_scale: float, cache_dtype: torch.dtype) -> None:
    """Scales are finite and positive; only an FP8 cache may have scales other than 1."""
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        check(isinstance(value, (int, float)) and math.isfinite(value) and value > 0,
              f"{name} must be a finite float > 0, got {value!r}")
    check(is_fp8(cache_dtype) or (k_scale == 1.0 and v_scale == 1.0),
          f"k_scale/v_scale ({k_scale}, {v_scale}) apply to a float8_e4m3fn cache only, not a {cache_dtype} one")


def quantize_e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x (any float dtype) -> float8_e4m3fn: x / scale in float32, clamped to +-448, rounded to
    nearest even. The divisor is a tensor so that CUDA divides too (a Python scalar divisor
    becomes a multiplication by its reciprocal there), as the store kernel does."""
    divisor = torch.full((), float(scale), dtype=torch.float32, device=x.device)
    return (x.float() / divisor).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_e4m3(q: torch.Tensor, scale: float) -> torch.Tensor:
    """float8_e4m3fn -> float32 values q * scale."""
    return q.float() * float(scale)


def encode_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """K or V rows as a cache of cache_dtype stores them (quantized into an FP8 one)."""
    return quantize_e4m3(x, scale) if is_fp8(cache_dtype) else x.to(cache_dtype)


def decode_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache values as float32 (dequantized from an FP8 cache)."""
    return dequantize_e4m3(x, scale) if is_fp8(x.dtype) else x.float()
