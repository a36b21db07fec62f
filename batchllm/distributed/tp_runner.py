"""The model runner of a tensor-parallel rank: rank 0 broadcasts each step's inputs, then every
rank runs the same forward on its shard; only rank 0 samples."""

from __future__ import annotations

import torch

from batchllm.distributed.step_broadcast import StepBroadcaster
from batchllm.engine.model_runner import ModelRunner, StepResult
from batchllm.engine.sampler import SamplingBatch, sample
from batchllm.engine.step_inputs import StepInputs
from batchllm.sched.interface import SchedulerOutput


class TPModelRunner(ModelRunner):
    """ModelRunner over a shard (arch = the shard's architecture: heads and KV heads per rank)."""

    def __init__(self, *args, broadcaster: StepBroadcaster, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.broadcaster = broadcaster

    @torch.inference_mode()
    def forward_logits(self, inputs: StepInputs) -> torch.Tensor | None:
        """Every rank: the shard forward (all-reduces inside); full-vocab logits of the sampled rows."""
        hidden = self.forward(inputs, allow_graph=False)
        if inputs.sample_rows.size == 0:
            return None
        return self.model.compute_logits(hidden[self._to_device(inputs.sample_rows)])  # all-gather

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, sampling_rows: list[tuple],
                previous_token_ids: torch.Tensor | None = None, allow_graph: bool = False) -> StepResult:
        """Rank 0 only. One step at a time (the workers receive host inputs, so there are no
        placeholder ids to resolve) and no CUDA graphs: both arguments are for the signature."""
        if previous_token_ids is not None:
            raise ValueError("the tensor-parallel runner does not take placeholder input ids")
        inputs = self.step_inputs(output)  # rank 0's persistent block tables; workers get the arrays
        self.broadcaster.send(inputs)
        logits = self.forward_logits(inputs)
        if logits is None:
            return StepResult((), None)
        return StepResult(inputs.sample_seq_ids, sample(logits, SamplingBatch.build(sampling_rows, self.device)))

    def serve(self) -> None:
        """Workers: run steps until rank 0 says stop."""
        while (inputs := self.broadcaster.receive()) is not None:
            self.forward_logits(inputs)
