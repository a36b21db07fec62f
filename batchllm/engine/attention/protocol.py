"""What every attention backend offers the model runner, PagedAttention and the decode CUDA graphs.

A backend turns a step's host arrays into a plan once per step (`build_plan`, on the host), moves
it to the device once (`plan_to_device`), and then, for every layer, stores the step's K/V
(`store`) and attends over the paged cache (`attend`). Every backend's store / attend take the
cache's k_scale / v_scale: 1.0 for a cache in the model dtype, the dequantization scales of a
float8_e4m3fn one (docs/design.md, "FP8 KV cache")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

from batchllm.attention_plan.work_list import PrefixSharedPlan
from batchllm.engine.step_inputs import StepInputs
from batchllm.ops.plan_device import PrefixSharedPlanOnDevice
from batchllm.ops.transfer import Upload

HostPlan = TypeVar("HostPlan")
DevicePlan = TypeVar("DevicePlan")


@dataclass(frozen=True)
class AttentionMetadata(Generic[DevicePlan]):
    """Device tensors of one step, shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] int64 (negative: the row stores no KV)
    positions: torch.Tensor  # [num_tokens] int64 (the kernels read it with a sliding window)
    plan: DevicePlan  # the backend's plan of the step (plan_to_device(build_plan(inputs)))


class AttentionBackend(Protocol[HostPlan, DevicePlan]):
    # Whether CUDA graphs can capture this backend's store and a decode step's attend: then it is
    # a GraphAttentionBackend (its plans are work lists of fixed layout, engine/cuda_graphs.py).
    supports_cuda_graphs: bool
    # The sliding window of every layer (None: full attention); (): no layer has one.
    layer_windows: tuple[int | None, ...]

    def build_plan(self, inputs: StepInputs) -> HostPlan:
        """The step's plan on the host; built once per step, shared by every layer."""
        ...

    def plan_to_device(self, plan: HostPlan, device: torch.device, upload: Upload | None = None) -> DevicePlan:
        """The plan on the device (without blocking the host on a GPU). upload: how its arrays
        travel (the runner's PinnedStaging.upload); None: a one-off copy (tests, tools)."""
        ...

    def store(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              metadata: AttentionMetadata[DevicePlan], k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """Write the step's K/V ([num_tokens, num_kv_heads, head_dim]) to its cache slots."""
        ...

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               metadata: AttentionMetadata[DevicePlan], scale: float, window: int | None = None,
               k_scale: float = 1.0, v_scale: float = 1.0, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of every row ([num_tokens, num_heads, head_dim]) over its KV in the cache;
        out: a tensor shaped like query to write it to (and return), None: a new one."""
        ...


class GraphAttentionBackend(AttentionBackend[PrefixSharedPlan, PrefixSharedPlanOnDevice], Protocol):
    """A backend whose decode steps a CUDA graph captures (supports_cuda_graphs is True): its plans
    are work lists, which the graph copies into static buffers laid out by attention_plan.layout;
    its store, which reads nothing of the plan, is captured in the piecewise graphs."""

    num_sms: int  # the device's SM count: the graphs' persistent launches size their grids by it
