"""Per-run execution switches."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunOptions:
    """Per-run execution switches for benchmarks and debugging, passed to `LLMEngine.run` (or
    `LLM.generate` / `LLM.chat`). EngineConfig gives the defaults: a switch turned off there
    (enforce_eager, async_scheduling=False) stays off, whatever the options say."""

    cuda_graphs: bool = True  # replay captured CUDA graphs for decode steps
    async_scheduling: bool = True  # schedule and launch step N+1 before step N's tokens are read
