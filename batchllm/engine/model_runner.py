"""Turns a SchedulerOutput into tensors, runs the model, samples the next tokens."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import cast

import torch

from batchllm.engine.attention.paged import PagedAttention
from batchllm.engine.attention.protocol import AttentionMetadata, GraphAttentionBackend
from batchllm.engine.attention.select import make_backend
from batchllm.engine.batch_rows import BatchRows
from batchllm.engine.cuda_graphs import DecodeGraphRunner
from batchllm.engine.kv_cache import KVCache
from batchllm.engine.last_tokens import FedRows, LastTokenColumn
from batchllm.engine.sampler import SamplerOutput, SamplingBatch, StepConstraint, sample
from batchllm.engine.step_inputs import StepInputs, build_step_inputs
from batchllm.engine.step_observer import StepObserver
from batchllm.engine.step_result import StepResult
from batchllm.models.config import ModelArchConfig
from batchllm.ops.transfer import upload_arrays
from batchllm.sched.interface import SchedulerOutput


class ModelRunner:
    """The StepRunner of one device (engine/step_runner.py)."""

    def __init__(self, model: torch.nn.Module, arch: ModelArchConfig, kv_cache: KVCache, block_size: int,
                 device: torch.device, attention_backend: str, cuda_graphs: bool = True) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.backend = make_backend(attention_backend, device, block_size, arch.num_heads, arch.num_kv_heads,
                                    arch.head_dim, arch.layer_windows)
        self.scale = arch.head_dim ** -0.5
        self.rows = BatchRows()  # the persistent batch: host rows kept from step to step
        self.last_tokens = LastTokenColumn(device, self.rows.num_rows)  # each row's last sampled id
        self.graphs: DecodeGraphRunner | None = None
        if cuda_graphs and device.type == "cuda" and self.backend.supports_cuda_graphs:
            graph_backend = cast(GraphAttentionBackend, self.backend)  # what supports_cuda_graphs declares
            self.graphs = DecodeGraphRunner(model, kv_cache, graph_backend, self.scale, device)
        # A profiler's hook around every execute (StepObserver); None: no cost but this check.
        self.observer: StepObserver | None = None

    def execute(self, output: SchedulerOutput, sampling_rows: list[tuple], allow_graph: bool = True,
                constraint: StepConstraint | None = None) -> StepResult:
        """sampling_rows: one SamplingBatch.build row per sampled chunk, in chunk order.
        allow_graph: False runs a decode step eagerly even when a CUDA graph could replay it.
        constraint: gives the token bitmask of the structured-output rows, asked for after the forward is queued."""
        observer = self.observer
        if observer is None:
            return self._execute(output, sampling_rows, allow_graph, constraint)
        replays = self.graphs.num_replays if self.graphs is not None else 0
        observer.step_started(output)
        try:
            return self._execute(output, sampling_rows, allow_graph, constraint)
        finally:
            observer.step_launched(output, self.graphs is not None and self.graphs.num_replays > replays)

    @torch.inference_mode()
    def _execute(self, output: SchedulerOutput, sampling_rows: list[tuple], allow_graph: bool,
                 constraint: StepConstraint | None = None) -> StepResult:
        inputs = self.step_inputs(output)
        if not sampling_rows:  # (then no row is fed either: a decode row samples)
            self.forward(inputs, allow_graph)
            return StepResult((), None)
        # Sampling settings and row indices go to the device before the forward is queued (no
        # wait behind it).
        batch = SamplingBatch.build(sampling_rows, self.device)
        indices = upload_arrays({name: getattr(inputs, name) for name in _ROW_INDICES}, self.device)
        hidden = self.forward(inputs, allow_graph, _fed_rows(inputs, indices))
        # Only the rows that sample pay for the LM head.
        logits = self.model.compute_logits(hidden[indices["sample_rows"]])
        bitmask = constraint.token_bitmask(logits.shape[-1], self.device) if constraint is not None else None
        sampled = sample(logits, batch, bitmask)
        self.last_tokens.store(indices["sample_batch_rows"], sampled.token_ids)
        if self.device.type != "cuda":
            return StepResult(inputs.sample_seq_ids, sampled)
        host = SamplerOutput(*(_copy_to_pinned(t) for t in (sampled.token_ids, sampled.logprobs,
                                                           sampled.top_logprobs, sampled.top_token_ids)))
        ready = torch.cuda.Event()
        ready.record()
        return StepResult(inputs.sample_seq_ids, sampled, host, ready)

    def step_inputs(self, output: SchedulerOutput) -> StepInputs:
        """The step's host arrays, from the persistent rows."""
        inputs = build_step_inputs(output, self.block_size, self.rows.step_rows(output))
        self.last_tokens.fit(self.rows.num_rows)
        return inputs

    def forward(self, inputs: StepInputs, allow_graph: bool = True, fed: FedRows | None = None) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of a step: a CUDA graph for decode steps, else eager.
        fed: the step's rows fed from the last-token column, on the device (None: uploaded here)."""
        if fed is None and inputs.fed_rows.size:
            fed = _fed_rows(inputs, upload_arrays({name: getattr(inputs, name) for name in _FED}, self.device))
        feed = partial(self.last_tokens.feed, fed=fed)
        host_plan = self.backend.build_plan(inputs)
        hidden = self.graphs.run(inputs, host_plan, feed) if self.graphs is not None and allow_graph else None
        return hidden if hidden is not None else self._forward_eager(inputs, host_plan, feed)

    def _forward_eager(self, inputs: StepInputs, host_plan, feed: Callable[[torch.Tensor], None]) -> torch.Tensor:
        """host_plan: the backend's build_plan(inputs)."""
        device = upload_arrays({name: getattr(inputs, name) for name in _UPLOADED}, self.device)
        input_ids = device.pop("input_ids")
        feed(input_ids)
        metadata = AttentionMetadata(device["slot_mapping"], device["positions"],
                                     self.backend.plan_to_device(host_plan, self.device))
        attention = PagedAttention(self.kv_cache, metadata, self.backend, self.scale)
        return self.model(input_ids, metadata.positions, attention)


def _fed_rows(inputs: StepInputs, indices: dict[str, torch.Tensor]) -> FedRows | None:
    if not inputs.fed_rows.size:
        return None
    return FedRows(indices["fed_rows"], indices["fed_batch_rows"], inputs.fed_rows.size == inputs.num_tokens)


_UPLOADED = ("input_ids", "positions", "slot_mapping")
_FED = ("fed_rows", "fed_batch_rows")
_ROW_INDICES = ("sample_rows", "sample_batch_rows", *_FED)


def _copy_to_pinned(tensor: torch.Tensor | None) -> torch.Tensor | None:
    if tensor is None:
        return None
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
