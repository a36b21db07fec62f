"""`simple` policy: FCFS continuous batching with chunked prefill, no prefix sharing: the reference
the other policies are tested against (docs/design.md); the baselines' machinery, cache off."""

from __future__ import annotations

import dataclasses

from batchllm.sched.config import SchedulerConfig
from batchllm.sched.interface import SchedulerOutput
from batchllm.sched.policies.cached_base import CachedPolicyBase


class SimpleScheduler(CachedPolicyBase):
    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(dataclasses.replace(config, enable_prefix_caching=False), leaf_only_eviction=False)

    def schedule(self) -> SchedulerOutput:
        # Running requests first, in admission order; preempt from the back when out of blocks.
        budget = self.config.max_num_batched_tokens
        scheduled, preempted, budget = self.schedule_running(list(self.running), budget)
        max_seqs = self.config.max_num_seqs
        while self.waiting and budget > 0 and not preempted:
            if max_seqs is not None and len(self.running) >= max_seqs:
                break
            state = self.waiting[0]
            num_tokens = min(state.num_pending_tokens, budget)
            if not self.grow(state, num_tokens):
                break
            self.waiting.popleft()
            self.running.append(state)
            scheduled.append((state, num_tokens))
            budget -= num_tokens
        return self.build_output(scheduled, preempted)
