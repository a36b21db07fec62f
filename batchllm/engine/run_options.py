"""Per-run execution switches."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunOptions:
    """For benchmarks and debugging, passed to `LLMEngine.run` (or `LLM.generate` / `LLM.chat`). A
    switch turned off in EngineConfig (enforce_eager, async_scheduling=False) stays off."""

    cuda_graphs: bool = True  # run steps through the captured CUDA graphs (whole-step or piecewise)
    async_scheduling: bool = True  # schedule and launch step N+1 before step N's tokens are read
