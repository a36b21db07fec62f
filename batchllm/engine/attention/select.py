"""An attention backend by name (EngineConfig.attention_backend)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from batchllm.engine.attention.batched_torch import BatchedTorchBackend
from batchllm.engine.attention.protocol import AttentionBackend
from batchllm.engine.attention.reference import ReferenceBackend
from batchllm.engine.attention.triton_backend import TritonBackend
from batchllm.ops.kv_quant import is_fp8
from batchllm.ops.xqa_decode import XqaDecode, check_xqa_supported, xqa_installed


@dataclass(frozen=True)
class AttentionShape:
    """What the choice of a backend reads from the model and its cache."""
    block_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_windows: tuple[int | None, ...] = ()  # each layer's sliding window (ModelArchConfig.layer_windows)
    kv_cache_dtype: torch.dtype | None = None  # None: the model dtype
    query_dtype: torch.dtype = torch.bfloat16  # the model's activations


@dataclass(frozen=True)
class SelectedBackend:
    name: str  # what "auto" became
    backend: AttentionBackend[Any, Any]


def xqa_fits(device: torch.device, shape: AttentionShape) -> bool:
    """Whether XQA can run this engine's decode rows: FlashInfer installed, and nothing that
    check_xqa_supported names in its way (a Hopper GPU, an FP8 cache, its page sizes and heads)."""
    if device.type != "cuda" or not xqa_installed():
        return False
    try:
        check_xqa_supported(device, shape.kv_cache_dtype, shape.block_size, shape.head_dim, shape.layer_windows)
    except ValueError:
        return False
    return True


def resolve_backend_name(name: str, device: torch.device, shape: AttentionShape | None = None) -> str:
    """"auto": `xqa` where it fits this engine (xqa_fits; on an H200 it ran every measured FP8-cache
    workload, shared prefixes included, at least as fast as `fused`, up to 11% faster), `fused` on
    other CUDA engines, `torch` elsewhere. Without a shape, CUDA's auto is `fused`, the backend xqa
    extends (what the host checks need)."""
    if name != "auto":
        return name
    if device.type != "cuda":
        return "torch"
    return "xqa" if shape is not None and xqa_fits(device, shape) else "fused"


def select_backend(name: str, device: torch.device, shape: AttentionShape) -> SelectedBackend:
    """The backend `name` names on this engine (shape: its heads, KV blocks, layers' sliding windows
    and cache dtype; the Triton backends tile an FP8 cache's decode steps their own way). XQA is
    built here, at start-up (seconds to minutes the first time, then loaded from FlashInfer's
    cache); when "auto" picked it and the build fails (no nvcc, for one), a warning says why and
    the engine runs `fused`."""
    resolved = resolve_backend_name(name, device, shape)
    if resolved == "reference":
        return SelectedBackend(resolved, ReferenceBackend(shape.layer_windows))
    if resolved == "torch":
        return SelectedBackend(resolved, BatchedTorchBackend(shape.block_size, shape.layer_windows))
    if resolved == "xqa":  # `fused`, with XQA's decode graphs (ops/xqa_decode.py)
        check_xqa_supported(device, shape.kv_cache_dtype, shape.block_size, shape.head_dim, shape.layer_windows)
        try:
            xqa = XqaDecode(device)
            xqa.build(shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.block_size)
        except Exception as error:  # noqa: BLE001 - the build's failures vary (compiler, loader, CUDA)
            if name != "auto":
                raise
            warnings.warn(f"attention backend auto: XQA could not be built ({error}); running the fused backend "
                          "(--attention-backend fused keeps this quiet)", RuntimeWarning, stacklevel=2)
            return select_backend("fused", device, shape)
        return SelectedBackend(resolved, _triton_backend(device, shape, uses_groups=True, kv_fp8=True, xqa=xqa,
                                                         fa3_dense=_fa3_dense(device, shape)))
    if resolved in ("triton", "fused"):
        kv_fp8 = shape.kv_cache_dtype is not None and is_fp8(shape.kv_cache_dtype)
        return SelectedBackend(resolved, _triton_backend(device, shape, uses_groups=resolved == "fused",
                                                         kv_fp8=kv_fp8))
    raise ValueError(f"unknown attention backend {name!r}")


def _triton_backend(device: torch.device, shape: AttentionShape, uses_groups: bool, kv_fp8: bool,
                    xqa: XqaDecode | None = None, fa3_dense: Any = None) -> TritonBackend:
    return TritonBackend(shape.block_size, shape.num_heads, shape.num_kv_heads, shape.head_dim, device,
                         uses_groups=uses_groups, layer_windows=shape.layer_windows, kv_fp8=kv_fp8, xqa=xqa,
                         fa3_dense=fa3_dense)


def fa3_dense_fits(device: torch.device, shape: AttentionShape) -> bool:
    """Whether FA3's FP8 prefill (ops/fa3_dense.py) can run this `xqa` engine's dense calls: a
    Hopper GPU (FA3 is built for sm_90a alone), its head sizes, a 16-bit model, no sliding window
    (dense calls have no sliding-window path)."""
    from batchllm.ops.fa3_dense import HEAD_DIMS

    return (device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
            and shape.head_dim in HEAD_DIMS and shape.query_dtype in (torch.float16, torch.bfloat16)
            and all(window is None for window in shape.layer_windows))


def _fa3_dense(device: torch.device, shape: AttentionShape) -> Any:
    """FA3's FP8 prefill for an `xqa` engine, built now (minutes the first time, then loaded from
    FlashInfer's cache), or None where it does not fit; when the build fails, a warning says why
    and the dense calls run on cuDNN in bf16 products."""
    if not fa3_dense_fits(device, shape):
        return None
    from batchllm.ops.fa3_dense import Fa3Dense

    try:
        fa3 = Fa3Dense(device, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.query_dtype)
        fa3.build()
    except Exception as error:  # noqa: BLE001 - the build's failures vary (compiler, loader, CUDA)
        warnings.warn(f"attention backend xqa: FA3's FP8 prefill could not be built ({error}); dense prompt "
                      "attention runs on cuDNN in bf16 products", RuntimeWarning, stacklevel=3)
        return None
    return fa3

