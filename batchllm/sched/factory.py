"""Policy name -> Scheduler (torch-free)."""

from __future__ import annotations

from batchllm.sched.config import SchedulerConfig
from batchllm.sched.interface import Scheduler
from batchllm.sched.policies.batchllm import BatchLLMScheduler
from batchllm.sched.policies.sglang import SglangScheduler
from batchllm.sched.policies.vllm import VllmScheduler
from batchllm.sched.simple import SimpleScheduler

SCHEDULERS = {"batchllm": BatchLLMScheduler, "vllm": VllmScheduler, "sglang": SglangScheduler,
              "simple": SimpleScheduler}


def make_scheduler(config: SchedulerConfig) -> Scheduler:
    """config.policy (validated by SchedulerConfig) -> its scheduler."""
    if config.policy not in SCHEDULERS:
        raise ValueError(f"unknown scheduling policy {config.policy!r}")
    return SCHEDULERS[config.policy](config)
