"""The seam a profiler uses to watch the host's part of each step (ModelRunner.observer)."""

from __future__ import annotations

from typing import Protocol

from batchllm.sched.interface import SchedulerOutput


class StepObserver(Protocol):
    """Called around ModelRunner.execute: building a step's inputs, launching its forward (eagerly or
    through CUDA graphs) and launching the sampler. Both calls run on the host, before the
    step's GPU work is waited for, so what happens between them is the step's host launch."""

    def step_started(self, output: SchedulerOutput) -> None:
        """Before the step's inputs are built."""

    def step_launched(self, output: SchedulerOutput, mode: str) -> None:
        """After the step is launched (also when the launch raised); mode: how its forward ran,
        "graph_replay" (a whole-step CUDA graph), "piecewise" (piecewise graphs with eager attention
        between them) or "eager" (model_runner.StepMode)."""
