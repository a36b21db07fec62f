"""The paged KV cache tensors and their sizing."""

from __future__ import annotations

from dataclasses import dataclass

import torch

CPU_DEFAULT_KV_TOKENS = 32768


@dataclass
class KVCache:
    # k, v: [num_layers, num_blocks, block_size, num_kv_heads, head_dim]
    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> "KVCache":
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

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
    return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


def choose_num_kv_tokens(device: torch.device, bytes_per_token: int, requested_tokens: int | None,
                         gpu_memory_utilization: float, activation_reserve_bytes: int) -> int:
    """KV capacity in tokens: the user's number, else what fits in free GPU memory after the
    weights and an activation reserve, else a CPU default."""
    if requested_tokens is not None:
        return requested_tokens
    if device.type != "cuda":
        return CPU_DEFAULT_KV_TOKENS
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    used_elsewhere = total_bytes - free_bytes
    budget = int(total_bytes * gpu_memory_utilization) - used_elsewhere - activation_reserve_bytes
    if budget < bytes_per_token * 256:
        raise RuntimeError(
            f"not enough GPU memory for a KV cache ({budget / 2**30:.1f} GiB left after the weights): "
            "lower --max-num-batched-tokens, raise --gpu-memory-utilization or use a smaller model"
        )
    return budget // bytes_per_token
