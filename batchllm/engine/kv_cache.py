"""The paged KV cache tensors and their sizing."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchllm.config import CacheConfig
from batchllm.engine.errors import EngineConfigError
from batchllm.ops.kv_quant import check_kv_scales, is_fp8

CPU_DEFAULT_KV_TOKENS = 32768


@dataclass
class KVCache:
    # k, v: [num_layers, num_blocks, block_size, num_kv_heads, head_dim], in the model dtype or
    # float8_e4m3fn (docs/design.md, "FP8 KV cache")
    k: torch.Tensor
    v: torch.Tensor
    # An FP8 cache's dequantization scales, one per cache: a stored value q stands for q * scale.
    # 1.0 for a cache in the model dtype.
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.k.dtype != self.v.dtype:
            raise ValueError(f"k and v caches differ in dtype: {self.k.dtype} / {self.v.dtype}")
        check_kv_scales(self.k_scale, self.v_scale, self.k.dtype)

    @classmethod
    def allocate(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> "KVCache":
        """dtype: the model dtype, or torch.float8_e4m3fn with its k_scale / v_scale."""
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        check_kv_scales(k_scale, v_scale, dtype)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                   k_scale, v_scale)

    @property
    def is_fp8(self) -> bool:
        return is_fp8(self.k.dtype)

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]


def num_kv_blocks(num_kv_tokens: int, block_size: int) -> int:
    """Whole blocks in a KV budget (rounded down); a budget under one block is an error, not
    silently one block."""
    if num_kv_tokens < block_size:
        raise ValueError(f"a KV cache of {num_kv_tokens} tokens is less than one block of {block_size} tokens: "
                         f"give at least {block_size} KV cache tokens")
    return num_kv_tokens // block_size


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V bytes of one token over all layers in a cache of `dtype` (FP8: 1 byte a value)."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


def choose_num_kv_tokens(device: torch.device, bytes_per_token: int, cache: CacheConfig,
                         activation_reserve_bytes: int) -> int:
    """KV capacity in tokens: the user's number (if the device's free memory holds it), else what
    fits in free GPU memory after the weights and an activation reserve, else a CPU default."""
    requested_tokens = cache.kv_cache_tokens
    if requested_tokens is not None:
        _check_fits(device, requested_tokens, bytes_per_token)
        return requested_tokens
    if device.type != "cuda":
        return CPU_DEFAULT_KV_TOKENS
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    used_elsewhere = total_bytes - free_bytes
    budget = int(total_bytes * cache.gpu_memory_utilization) - used_elsewhere - activation_reserve_bytes
    if budget < bytes_per_token * 256:
        raise RuntimeError(
            f"not enough GPU memory for a KV cache ({budget / 2**30:.1f} GiB left after the weights): "
            "lower --max-num-batched-tokens, raise --gpu-memory-utilization or use a smaller model"
        )
    return budget // bytes_per_token


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory a new allocation on the device can take: free GPU memory, or the host's available
    memory (MemAvailable of /proc/meminfo); None where the host does not say."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _check_fits(device: torch.device, num_tokens: int, bytes_per_token: int) -> None:
    """Refuse a requested KV cache that the device's free memory cannot hold (rather than an
    allocator's traceback, or the host's out-of-memory killer)."""
    free_bytes = free_memory_bytes(device)
    if free_bytes is None or num_tokens * bytes_per_token <= free_bytes:
        return
    raise EngineConfigError(
        f"--kv-cache-tokens {num_tokens} needs {num_tokens * bytes_per_token / 2**30:.1f} GiB of KV cache and "
        f"{device.type} has {free_bytes / 2**30:.1f} GiB free: give at most {free_bytes // bytes_per_token} "
        "(or leave it out for the default size)")
