"""The engine's AttentionFn: store the step's K/V in the paged cache, then attend with the engine's
backend (docs/design.md, "The engine and the model runner").

Every backend's store / attend take the cache's k_scale / v_scale: 1.0 for a cache in the model
dtype, the dequantization scales of a float8_e4m3fn one (docs/design.md, "FP8 KV cache")."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from batchllm.engine.kv_cache import KVCache
from batchllm.engine.step_inputs import StepInputs
from batchllm.ops.transfer import upload_arrays
from batchllm.ops import reference


@dataclass
class AttentionMetadata:
    """Device tensors of one step, shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64 (the kernels read it with a sliding window)
    plan: Any = None  # the backend's per-step plan (backend.prepare), e.g. the fused work list


class ReferenceBackend:
    """The PyTorch oracle, one seq at a time."""

    layer_windows: tuple[int | None, ...] = ()  # per layer sliding window (None: full); (): none

    def prepare(self, inputs: StepInputs, metadata: AttentionMetadata) -> None:
        names = ("query_start_loc", "seq_lens", "shared_kv_lens", "block_tables")
        metadata.plan = upload_arrays({n: getattr(inputs, n) for n in names}, metadata.slot_mapping.device)

    def store(self, key, value, k_cache, v_cache, metadata: AttentionMetadata, k_scale: float = 1.0,
              v_scale: float = 1.0) -> None:
        reference.store_kv_reference(key, value, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale)

    def attend(self, query, k_cache, v_cache, metadata: AttentionMetadata, scale: float,
               window: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        plan = metadata.plan
        return reference.paged_attention_reference(
            query, k_cache, v_cache, plan["query_start_loc"], plan["seq_lens"], plan["shared_kv_lens"],
            plan["block_tables"], scale, sliding_window=window, k_scale=k_scale, v_scale=v_scale,
        )


class TritonPagedBackend(ReferenceBackend):
    """Plain paged attention (what the vllm / sglang baseline policies run): every seq reads its
    whole block table; no knowledge of prefix-sharing groups."""

    supports_cuda_graphs = True
    uses_groups = False  # whether the work list knows the step's prefix-sharing groups

    def __init__(self, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 device: torch.device) -> None:
        from batchllm.ops.kv_store import store_kv
        from batchllm.ops.prefix_attention import prefix_shared_attention
        from batchllm.ops.tile_config import decode_tile_config
        from batchllm.ops.work_list import device_num_sms

        self._store_kv = store_kv
        self._attention = prefix_shared_attention
        self.block_size, self.num_heads, self.num_kv_heads = block_size, num_heads, num_kv_heads
        self.head_dim, self.device = head_dim, device
        self.num_sms = device_num_sms(device)  # split-KV pieces fill the device; CUDA graphs size their grids
        self.decode_tile = decode_tile_config(head_dim, num_heads // num_kv_heads)
        # decode steps run their BIG and SMALL launches concurrently, the BIG one on this stream
        self.side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def build_host_plan(self, inputs: StepInputs):
        """The step's work list on the host (numpy); one per step, shared by every layer."""
        from batchllm.ops.tile_config import default_tile_config
        from batchllm.ops.work_list import build_prefix_shared_plan

        # Decode-only steps (one row per seq: the CUDA-graph steps) run class-split launches
        # (decode_tile_config); steps with prefill chunks the default table (None).
        tile = self.decode_tile if inputs.decode_only else None  # decode tiles make no dense calls
        if not inputs.decode_only and any(window is not None for window in self.layer_windows):
            # dense calls have no sliding-window path
            tile = replace(default_tile_config(self.head_dim, self.num_heads // self.num_kv_heads), dense_min_rows=0)
        groups = (inputs.group_ids, inputs.is_prefix) if self.uses_groups else (None, None)
        return build_prefix_shared_plan(
            inputs.query_start_loc, inputs.seq_lens, inputs.shared_kv_lens, inputs.block_tables, *groups,
            block_size=self.block_size, num_kv_heads=self.num_kv_heads, num_heads=self.num_heads,
            head_dim=self.head_dim, tile=tile, num_sms=self.num_sms,
        )

    def prepare(self, inputs: StepInputs, metadata: AttentionMetadata) -> None:
        metadata.plan = self.build_host_plan(inputs).to(self.device)

    def store(self, key, value, k_cache, v_cache, metadata: AttentionMetadata, k_scale: float = 1.0,
              v_scale: float = 1.0) -> None:
        self._store_kv(key, value, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale)

    def attend(self, query, k_cache, v_cache, metadata: AttentionMetadata, scale: float,
               window: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        return self._attention(query, k_cache, v_cache, metadata.plan, scale, window, metadata.positions,
                               k_scale, v_scale, self.side_stream)


class FusedPrefixBackend(TritonPagedBackend):
    """BatchLLM section 5: prefix tiles (a group's rows x its shared prefix KV, a MatMul) and
    distinct tiles in one launch over a host-built work list."""

    uses_groups = True


def make_backend(name: str, device: torch.device, block_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, layer_windows: tuple[int | None, ...] = ()):
    """layer_windows: the sliding window of every layer (ModelArchConfig.layer_windows)."""
    if name == "auto":
        name = "fused" if device.type == "cuda" else "torch"
    if name == "reference":
        backend = ReferenceBackend()
    elif name == "torch":
        from batchllm.engine.cpu_attention import BatchedTorchBackend

        backend = BatchedTorchBackend(block_size)
    elif name in ("triton", "fused"):
        backend_class = FusedPrefixBackend if name == "fused" else TritonPagedBackend
        backend = backend_class(block_size, num_heads, num_kv_heads, head_dim, device)
    else:
        raise ValueError(f"unknown attention backend {name!r}")
    backend.layer_windows = tuple(layer_windows)
    return backend


class PagedAttention:
    """Implements the model's AttentionFn for one step."""

    def __init__(self, kv_cache: KVCache, metadata: AttentionMetadata, backend, scale: float) -> None:
        self.kv_cache, self.metadata, self.backend, self.scale = kv_cache, metadata, backend, scale

    def __call__(self, layer_index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        # query: [num_tokens, num_heads, head_dim]; key/value: [num_tokens, num_kv_heads, head_dim]
        k_cache, v_cache = self.kv_cache.k[layer_index], self.kv_cache.v[layer_index]
        # Every row's KV is stored before any row reads (a prefix chunk and its members'
        # first chunks may share the step: docs/design.md, "KV addressing").
        k_scale, v_scale = self.kv_cache.k_scale, self.kv_cache.v_scale
        self.backend.store(key, value, k_cache, v_cache, self.metadata, k_scale, v_scale)
        windows = self.backend.layer_windows
        return self.backend.attend(query, k_cache, v_cache, self.metadata, self.scale,
                                   windows[layer_index] if windows else None, k_scale, v_scale)
