"""`vllm` baseline: vLLM v0.6's scheduler with chunked prefill and automatic prefix caching, on this
engine's BlockPool; what it reproduces is listed in docs/design.md ("Scheduling")."""

from __future__ import annotations

from batchllm.sched.config import SchedulerConfig
from batchllm.sched.interface import SchedulerOutput
from batchllm.sched.policies.cached_base import CachedPolicyBase

VLLM_DEFAULT_MAX_NUM_SEQS = 256
VLLM_WATERMARK_FRACTION = 0.01  # vLLM BlockSpaceManager watermark


class VllmScheduler(CachedPolicyBase):
    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config, leaf_only_eviction=False)
        self.max_num_seqs = config.max_num_seqs or VLLM_DEFAULT_MAX_NUM_SEQS
        self.watermark_blocks = int(VLLM_WATERMARK_FRACTION * config.num_kv_blocks)

    def schedule(self) -> SchedulerOutput:
        # Decodes first, then chunked prefills of running requests (vLLM v0.6 chunked prefill).
        candidates = [s for s in self.running if s.is_decoding] + [s for s in self.running if not s.is_decoding]
        scheduled, preempted, budget = self.schedule_running(candidates, self.config.max_num_batched_tokens)
        # New prefills, FCFS, only when no preemption happened this step.
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            nodes = self.match_cached(seq)
            needed = self.pool.blocks_for_tokens(seq.num_own_tokens) - len(nodes)
            available = self.num_available_blocks(nodes)
            if needed > available or (available - needed < self.watermark_blocks and self.running):
                break  # (the watermark never blocks an idle engine: no deadlock on tiny caches)
            self.waiting.popleft()
            self.start_with_cached(seq, nodes)
            seq.block_ids.extend(self.allocate(needed))
            num_tokens = min(seq.num_pending_tokens, budget)
            self.running.append(seq)
            scheduled.append((seq, num_tokens))
            budget -= num_tokens
        return self.build_output(scheduled, preempted)
