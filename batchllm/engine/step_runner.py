"""What the step loop calls on a runner (ModelRunner on one device, TPModelRunner on a rank)."""

from __future__ import annotations

from typing import Protocol

from batchllm.engine.prompt_logprobs import PromptLogprobRows
from batchllm.engine.sampler import StepConstraint
from batchllm.engine.sampling_rows import SamplingRows
from batchllm.engine.step_result import StepResult
from batchllm.sched.interface import SchedulerOutput


class StepRunner(Protocol):
    def execute(self, output: SchedulerOutput, sampling_rows: SamplingRows, allow_graph: bool = True,
                constraint: StepConstraint | None = None,
                prompt_logprobs: PromptLogprobRows | None = None) -> StepResult:
        """Run one scheduled step: its tensors, the model, the sampler.
        sampling_rows: the sampled chunks' settings as columns, in chunk order.
        allow_graph: False runs a decode step eagerly even when a CUDA graph could replay it.
        constraint: the structured-output rows' token bitmask, asked for between the forward and the sampler.
        prompt_logprobs: prompt rows whose logprobs the result carries (StepResult.prompt_logprobs)."""
        ...
