"""The `reference` attention backend: the PyTorch oracle (ops/reference.py), one sequence at a time."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchllm.engine.attention.protocol import AttentionMetadata
from batchllm.engine.step_inputs import StepInputs
from batchllm.ops import reference
from batchllm.ops.transfer import Upload, upload_arrays

_PLAN_ARRAYS = ("query_start_loc", "seq_lens", "shared_kv_lens", "block_tables")


@dataclass(frozen=True)
class ReferenceHostPlan:
    query_start_loc: np.ndarray  # [num_seqs + 1] int32
    seq_lens: np.ndarray  # [num_seqs] int32
    shared_kv_lens: np.ndarray  # [num_seqs] int32
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32


@dataclass(frozen=True)
class ReferencePlan:
    """ReferenceHostPlan's arrays on the device."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    shared_kv_lens: torch.Tensor
    block_tables: torch.Tensor


class ReferenceBackend:
    supports_cuda_graphs = False

    def __init__(self, layer_windows: tuple[int | None, ...] = ()) -> None:
        self.layer_windows = tuple(layer_windows)

    def build_plan(self, inputs: StepInputs) -> ReferenceHostPlan:
        return ReferenceHostPlan(*(getattr(inputs, name) for name in _PLAN_ARRAYS))

    def plan_to_device(self, plan: ReferenceHostPlan, device: torch.device,
                       upload: Upload | None = None) -> ReferencePlan:
        arrays = {name: getattr(plan, name) for name in _PLAN_ARRAYS}
        tensors = upload(arrays) if upload is not None else upload_arrays(arrays, device)
        return ReferencePlan(**tensors)

    def store(self, key, value, k_cache, v_cache, metadata: AttentionMetadata[ReferencePlan], k_scale: float = 1.0,
              v_scale: float = 1.0) -> None:
        reference.store_kv_reference(key, value, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale)

    def attend(self, query, k_cache, v_cache, metadata: AttentionMetadata[ReferencePlan], scale: float,
               window: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
               out: torch.Tensor | None = None) -> torch.Tensor:
        plan = metadata.plan
        result = reference.paged_attention_reference(
            query, k_cache, v_cache, plan.query_start_loc, plan.seq_lens, plan.shared_kv_lens, plan.block_tables,
            scale, sliding_window=window, k_scale=k_scale, v_scale=v_scale,
        )
        return result if out is None else out.copy_(result)
