"""What an engine offers the batch job, the LLM API and the bench. Three engines offer it:
LLMEngine (one device), TPEngine (the model split over the GPUs of one host) and RayEngine (data
parallel on Ray replicas); batchllm/engines.py builds the one a configuration asks for."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from batchllm.config import EngineConfig
from batchllm.engine.model_runner import ModelRunner
from batchllm.engine.request_limits import RequestLimits
from batchllm.engine.request_state import FinishedOutput, PreparedRequest, RunStats
from batchllm.engine.run_options import RunOptions
from batchllm.models.config import ModelArchConfig
from batchllm.models.tokenizer import Tokenizer
from batchllm.sampling_params import SamplingParams
from batchllm.sched.config import SchedulerConfig


class Engine(Protocol):
    config: EngineConfig
    model_name: str
    arch: ModelArchConfig  # the whole model's architecture
    tokenizer: Tokenizer | None  # None: the model has none (prompts must be token ids)

    @property
    def limits(self) -> RequestLimits:
        """What one request may hold (check every request with it before `run`)."""
        ...

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """Refuse a structured output that cannot run (batchllm.structured.errors.StructuredOutputError)
        and start compiling its grammar where the engine compiles it (call before `run`)."""
        ...

    def run(self, requests: list[PreparedRequest], on_step: Callable[[int, int], None] | None = None,
            stats: RunStats | None = None, options: RunOptions | None = None) -> Iterator[FinishedOutput]:
        """Run a batch of checked requests; yields each request as it finishes. on_step(num_finished,
        num_new_tokens) after every step (or update); stats: added to; options: per-run switches."""
        ...

    def shutdown(self) -> None:
        """Release what the engine holds outside this process (workers, replicas); idempotent."""
        ...


class LocalEngine(Engine, Protocol):
    """An engine whose steps run in this process (and its tensor-parallel workers): LLMEngine and
    TPEngine. The bench measures these and changes their scheduling between runs."""

    device: torch.device
    dtype: torch.dtype
    runner: ModelRunner  # its CUDA graphs (runner.graphs) count their replays

    @property
    def scheduler_config(self) -> SchedulerConfig:
        """The scheduling settings of the next run, with the KV blocks the cache holds."""
        ...

    @property
    def num_kv_tokens(self) -> int:
        ...

    def configure_scheduler(self, **changes) -> None:
        """Change scheduling settings (policy, token budget, ...) between runs."""
        ...
