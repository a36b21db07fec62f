"""An attention backend by name (EngineConfig.attention_backend)."""

from __future__ import annotations

from typing import Any

import torch

from batchllm.engine.attention.batched_torch import BatchedTorchBackend
from batchllm.engine.attention.protocol import AttentionBackend
from batchllm.engine.attention.reference import ReferenceBackend
from batchllm.engine.attention.triton_backend import TritonBackend
from batchllm.ops.kv_quant import is_fp8
from batchllm.ops.xqa_decode import XqaDecode, check_xqa_supported


def resolve_backend_name(name: str, device: torch.device) -> str:
    """"auto": `fused` on CUDA, `torch` elsewhere."""
    if name == "auto":
        return "fused" if device.type == "cuda" else "torch"
    return name


def make_backend(name: str, device: torch.device, block_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, layer_windows: tuple[int | None, ...] = (),
                 kv_cache_dtype: torch.dtype | None = None) -> AttentionBackend[Any, Any]:
    """layer_windows: the sliding window of every layer (ModelArchConfig.layer_windows).
    kv_cache_dtype: the KV cache's dtype (the Triton backends tile an FP8 cache's decode steps
    their own way); None: the model dtype."""
    name = resolve_backend_name(name, device)
    if name == "reference":
        return ReferenceBackend(layer_windows)
    if name == "torch":
        return BatchedTorchBackend(block_size, layer_windows)
    if name == "xqa":  # `fused`, with XQA's decode graphs (ops/xqa_decode.py)
        check_xqa_supported(device, kv_cache_dtype, block_size, head_dim, layer_windows)
        return TritonBackend(block_size, num_heads, num_kv_heads, head_dim, device, uses_groups=True,
                             layer_windows=layer_windows, kv_fp8=True, xqa=XqaDecode(device))
    if name in ("triton", "fused"):
        kv_fp8 = kv_cache_dtype is not None and is_fp8(kv_cache_dtype)
        return TritonBackend(block_size, num_heads, num_kv_heads, head_dim, device, uses_groups=name == "fused",
                             layer_windows=layer_windows, kv_fp8=kv_fp8)
    raise ValueError(f"unknown attention backend {name!r}")
