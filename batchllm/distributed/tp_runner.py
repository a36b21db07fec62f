"""The model runner of a tensor-parallel rank. Every rank runs the whole step: the shard forward
(all-reduces inside, captured in the CUDA graphs: whole-step graphs for decode steps, piecewise
graphs for the others, which every rank captures in the same order at start-up), then sampling
from the gathered full-vocab logits, which are the same on every rank, so every rank holds the
same tokens (docs/scale-out.md)."""

from __future__ import annotations

from batchllm.distributed.step_gate import StepGate, step_fingerprint
from batchllm.engine.errors import EngineBrokenError
from batchllm.engine.model_runner import ModelRunner
from batchllm.engine.sampler import StepConstraint
from batchllm.engine.sampling_rows import SamplingRows
from batchllm.engine.step_result import StepResult
from batchllm.sched.interface import SchedulerOutput


class TPModelRunner(ModelRunner):
    """ModelRunner over a shard (arch = the shard's architecture: heads and KV heads per rank)."""

    def __init__(self, *args, gate: StepGate, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = gate
        self.run_id = -1  # set by the engine before each run
        self.broken: BaseException | None = None

    def raise_if_broken(self) -> None:
        """A step that failed after its collectives began leaves the ranks disagreeing: refuse more."""
        if self.broken is not None:
            raise EngineBrokenError(f"an earlier step failed mid-way ({self.broken!r}); restart the engine")

    def execute(self, output: SchedulerOutput, sampling_rows: SamplingRows, allow_graph: bool = True,
                constraint: StepConstraint | None = None, prompt_logprobs=None) -> StepResult:
        self.raise_if_broken()
        self.gate.pass_step(self.run_id, step_fingerprint(self.run_id, output))
        try:
            return super().execute(output, sampling_rows, allow_graph, constraint, prompt_logprobs)
        except BaseException as error:
            self.broken = error
            raise

    def release_cuda_graphs(self) -> None:
        """Before leaving the process group: graphs with captured collectives must go first."""
        self.release_graphs()
