"""Switches of one engine run that leave the loaded model, the KV cache and the scheduler alone.

`batchllm bench` compares them on one loaded model (its '+eager' and '+sync' policy suffixes), so
they are chosen per run and reach the engine as an argument, never by setting engine attributes.
Without options a run follows its EngineConfig (`RunOptions.from_config`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunOptions:
    # False: decode steps run eagerly. True: they replay the engine's CUDA graphs, where it has
    # them (a CUDA device, a backend that supports them, and EngineConfig.enforce_eager off).
    cuda_graphs: bool = True
    # True: schedule and launch step N+1 while the device runs step N; False: one step at a time.
    async_scheduling: bool = True

    @classmethod
    def from_config(cls, config) -> RunOptions:
        """The options an EngineConfig implies: graphs unless enforce_eager, its async_scheduling."""
        return cls(cuda_graphs=not config.enforce_eager, async_scheduling=config.async_scheduling)
