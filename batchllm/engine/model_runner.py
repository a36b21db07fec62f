"""Turns a SchedulerOutput into tensors, runs the model, samples the next tokens."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchllm.engine.attention import AttentionMetadata, PagedAttention, make_backend
from batchllm.engine.kv_cache import KVCache
from batchllm.engine.sampler import SamplerOutput, SamplingBatch, sample
from batchllm.engine.step_inputs import StepInputs, build_step_inputs
from batchllm.sched.interface import SchedulerOutput


@dataclass(frozen=True)
class StepResult:
    seq_ids: tuple[int, ...]  # one per sampled row
    sampled: SamplerOutput | None  # None when nothing was sampled this step

    def token_ids_list(self) -> list[int]:
        """The sampled ids on the host (waits for the device)."""
        return self.sampled.token_ids.tolist() if self.sampled is not None else []


class ModelRunner:
    def __init__(self, model: torch.nn.Module, arch, kv_cache: KVCache, block_size: int,
                 device: torch.device, attention_backend: str, cuda_graphs: bool = True) -> None:
        self.model = model
        self.arch = arch
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.backend = make_backend(attention_backend, device, block_size, arch.num_heads, arch.num_kv_heads,
                                    arch.head_dim)
        self.scale = arch.head_dim ** -0.5
        self._pin = device.type == "cuda"
        self.graphs = None
        if cuda_graphs and device.type == "cuda" and getattr(self.backend, "supports_cuda_graphs", False):
            from batchllm.engine.cuda_graphs import DecodeGraphRunner

            self.graphs = DecodeGraphRunner(model, kv_cache, self.backend, self.scale, device)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if self._pin:
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, sampling_rows: list[tuple]) -> StepResult:
        """sampling_rows: one SamplingBatch.build row per sampled chunk, in chunk order."""
        inputs = build_step_inputs(output, self.block_size)
        # Sampling settings go to the device before the forward is queued (no wait behind it).
        batch = SamplingBatch.build(sampling_rows, self.device) if sampling_rows else None
        hidden = self.forward(inputs)
        if batch is None:
            return StepResult((), None)
        # Only the rows that sample pay for the LM head.
        logits = self.model.compute_logits(hidden[self._to_device(inputs.sample_rows)])
        return StepResult(inputs.sample_seq_ids, sample(logits, batch))

    def forward(self, inputs: StepInputs, allow_graph: bool = True) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of a step: a CUDA graph for decode steps, else eager."""
        host_plan = self.backend.build_host_plan(inputs) if self.graphs is not None else None
        hidden = self.graphs.run(inputs, host_plan) if host_plan is not None and allow_graph else None
        return hidden if hidden is not None else self._forward_eager(inputs, host_plan)

    def _forward_eager(self, inputs: StepInputs, host_plan) -> torch.Tensor:
        metadata = AttentionMetadata(
            slot_mapping=self._to_device(inputs.slot_mapping),
            query_start_loc=self._to_device(inputs.query_start_loc),
            seq_lens=self._to_device(inputs.seq_lens),
            shared_kv_lens=self._to_device(inputs.shared_kv_lens),
            block_tables=self._to_device(inputs.block_tables),
            max_seq_len=inputs.max_seq_len,
        )
        if host_plan is not None:
            metadata.plan = host_plan.to(self.device)
        else:
            self.backend.prepare(inputs, metadata)
        attention = PagedAttention(self.kv_cache, metadata, self.backend, self.scale)
        return self.model(self._to_device(inputs.input_ids), self._to_device(inputs.positions), attention)
