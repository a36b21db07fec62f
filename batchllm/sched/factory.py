"""Policy name -> Scheduler (torch-free)."""

from __future__ import annotations

from batchllm.sched.config import SchedulerConfig
from batchllm.sched.interface import Scheduler


def make_scheduler(config: SchedulerConfig) -> Scheduler:
    """"batchllm" | "vllm" | "sglang" | "simple" (config.policy, validated by SchedulerConfig)."""
    if config.policy == "batchllm":
        from batchllm.sched.policies.batchllm import BatchLLMScheduler

        return BatchLLMScheduler(config)
    if config.policy == "vllm":
        from batchllm.sched.policies.vllm import VllmScheduler

        return VllmScheduler(config)
    if config.policy == "sglang":
        from batchllm.sched.policies.sglang import SglangScheduler

        return SglangScheduler(config)
    if config.policy == "simple":
        from batchllm.sched.simple import SimpleScheduler

        return SimpleScheduler(config)
    raise ValueError(f"unknown scheduling policy {config.policy!r}")
