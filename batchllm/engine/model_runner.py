"""Turns a SchedulerOutput into tensors, runs the model, samples the next tokens."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchllm.engine.attention import AttentionMetadata, PagedAttention, make_backend
from batchllm.engine.batch_rows import BatchRows
from batchllm.engine.kv_cache import KVCache
from batchllm.engine.placeholders import placeholder_source, resolve_placeholders_
from batchllm.engine.sampler import SamplerOutput, SamplingBatch, sample
from batchllm.engine.step_inputs import StepInputs, build_step_inputs
from batchllm.engine.step_observer import StepObserver
from batchllm.ops.transfer import to_device, upload_arrays
from batchllm.sched.interface import SchedulerOutput


@dataclass(frozen=True)
class StepResult:
    seq_ids: tuple[int, ...]  # one per sampled row
    sampled: SamplerOutput | None  # None when nothing was sampled this step (device tensors)
    # CUDA: pinned host copies of `sampled`, filled by a non-blocking copy queued right after
    # the sampler, and the event that marks them ready. Waiting on the event waits for this
    # step only; `.tolist()` on the device tensors would also wait for every step queued after
    # it (asynchronous scheduling queues the next step before reading this one).
    host_sampled: SamplerOutput | None = None
    host_ready: torch.cuda.Event | None = None

    def host_output(self) -> SamplerOutput | None:
        """The sampled output on the host (waits for this step's copy)."""
        if self.host_ready is None:
            return self.sampled
        self.host_ready.synchronize()
        return self.host_sampled


class ModelRunner:
    def __init__(self, model: torch.nn.Module, arch, kv_cache: KVCache, block_size: int,
                 device: torch.device, attention_backend: str, cuda_graphs: bool = True) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.backend = make_backend(attention_backend, device, block_size, arch.num_heads, arch.num_kv_heads,
                                    arch.head_dim, arch.layer_windows)
        self.scale = arch.head_dim ** -0.5
        self.rows = BatchRows()  # the persistent batch: host rows kept from step to step
        self.graphs = None
        if cuda_graphs and device.type == "cuda" and getattr(self.backend, "supports_cuda_graphs", False):
            from batchllm.engine.cuda_graphs import DecodeGraphRunner

            self.graphs = DecodeGraphRunner(model, kv_cache, self.backend, self.scale, device)
        # A profiler's hook around every execute (StepObserver); None: no cost but this check.
        self.observer: StepObserver | None = None

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)

    def execute(self, output: SchedulerOutput, sampling_rows: list[tuple],
                previous_token_ids: torch.Tensor | None = None, allow_graph: bool = True) -> StepResult:
        """sampling_rows: one SamplingBatch.build row per sampled chunk, in chunk order.
        previous_token_ids: the previous step's sampled ids on the device, for placeholder input ids.
        allow_graph: False runs a decode step eagerly even when a CUDA graph could replay it."""
        observer = self.observer
        if observer is None:
            return self._execute(output, sampling_rows, previous_token_ids, allow_graph)
        replays = self.graphs.num_replays if self.graphs is not None else 0
        observer.step_started(output)
        try:
            return self._execute(output, sampling_rows, previous_token_ids, allow_graph)
        finally:
            observer.step_launched(output, self.graphs is not None and self.graphs.num_replays > replays)

    @torch.inference_mode()
    def _execute(self, output: SchedulerOutput, sampling_rows: list[tuple],
                 previous_token_ids: torch.Tensor | None, allow_graph: bool) -> StepResult:
        inputs = self.step_inputs(output)
        # Sampling settings go to the device before the forward is queued (no wait behind it).
        batch = SamplingBatch.build(sampling_rows, self.device) if sampling_rows else None
        hidden = self.forward(inputs, allow_graph=allow_graph, previous_token_ids=previous_token_ids)
        if batch is None:
            return StepResult((), None)
        # Only the rows that sample pay for the LM head.
        logits = self.model.compute_logits(hidden[self._to_device(inputs.sample_rows)])
        sampled = sample(logits, batch)
        if self.device.type != "cuda":
            return StepResult(inputs.sample_seq_ids, sampled)
        host = SamplerOutput(*(_copy_to_pinned(t) for t in (sampled.token_ids, sampled.logprobs,
                                                           sampled.top_logprobs, sampled.top_token_ids)))
        ready = torch.cuda.Event()
        ready.record()
        return StepResult(inputs.sample_seq_ids, sampled, host, ready)

    def step_inputs(self, output: SchedulerOutput) -> StepInputs:
        """The step's host arrays, from the persistent rows."""
        return build_step_inputs(output, self.block_size, self.rows.step_rows(output))

    def forward(self, inputs: StepInputs, allow_graph: bool = True,
                previous_token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of a step: a CUDA graph for decode steps, else eager."""
        placeholders = placeholder_source(inputs.input_ids, previous_token_ids)
        host_plan = self.backend.build_host_plan(inputs) if self.graphs is not None else None
        hidden = (self.graphs.run(inputs, host_plan, placeholders)
                  if host_plan is not None and allow_graph else None)
        return hidden if hidden is not None else self._forward_eager(inputs, host_plan, placeholders)

    def _forward_eager(self, inputs: StepInputs, host_plan, placeholders: torch.Tensor | None = None) -> torch.Tensor:
        device = upload_arrays({name: getattr(inputs, name) for name in _UPLOADED}, self.device)
        input_ids = device.pop("input_ids")
        metadata = AttentionMetadata(**device)
        if host_plan is not None:
            metadata.plan = host_plan.to(self.device)
        else:
            self.backend.prepare(inputs, metadata)
        attention = PagedAttention(self.kv_cache, metadata, self.backend, self.scale)
        if placeholders is not None:
            resolve_placeholders_(input_ids, placeholders)
        return self.model(input_ids, metadata.positions, attention)


_UPLOADED = ("input_ids", "positions", "slot_mapping")


def _copy_to_pinned(tensor: torch.Tensor | None) -> torch.Tensor | None:
    if tensor is None:
        return None
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
