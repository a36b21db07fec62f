"""PagedAttention: the model's AttentionFn (models/llama.py) for one step: store the step's K/V in
the paged cache, then attend with the engine's backend. The piecewise CUDA graphs call the two
halves apart: the store inside a captured piece, the attention between pieces."""

from __future__ import annotations

from typing import Any

import torch

from batchllm.engine.attention.protocol import AttentionBackend, AttentionMetadata
from batchllm.engine.kv_cache import KVCache


class PagedAttention:
    def __init__(self, kv_cache: KVCache, metadata: AttentionMetadata, backend: AttentionBackend[Any, Any],
                 scale: float) -> None:
        self.kv_cache, self.metadata, self.backend, self.scale = kv_cache, metadata, backend, scale

    def __call__(self, layer_index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        # query: [num_tokens, num_heads, head_dim]; key/value: [num_tokens, num_kv_heads, head_dim]
        # Every row's KV is stored before any row reads (a prefix chunk and its members'
        # first chunks may share the step: docs/design.md, "KV addressing").
        self.store(layer_index, key, value)
        return self.attend(layer_index, query)

    def store(self, layer_index: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write the step's K/V rows of one layer to their slots (negative slots: nothing)."""
        self.backend.store(key, value, self.kv_cache.k[layer_index], self.kv_cache.v[layer_index], self.metadata,
                           self.kv_cache.k_scale, self.kv_cache.v_scale)

    def attend(self, layer_index: int, query: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of every row of one layer over the cache (its K/V stored first), written to out
        (shaped like query) when given."""
        windows = self.backend.layer_windows
        return self.backend.attend(query, self.kv_cache.k[layer_index], self.kv_cache.v[layer_index], self.metadata,
                                   self.scale, windows[layer_index] if windows else None, self.kv_cache.k_scale,
                                   self.kv_cache.v_scale, out)
