"""`vllm` baseline: vLLM v0.6 scheduler with chunked prefill and automatic prefix caching.

Faithful to vLLM v0.6 `Scheduler._schedule_chunked_prefill` + the prefix-caching block
manager, on this engine's BlockPool:
  - FCFS in input order; a request-count cap max_num_seqs (default 256) and a token budget
    max_num_batched_tokens (default 2048; vLLM's H100/H200 defaults 1024 seqs / 16384 tokens
    are `--max-num-seqs 1024 --max-num-batched-tokens 16384`).
  - Each step: running decodes first, then running prefill chunks, then new requests from
    the waiting queue (only when nothing was preempted this step, as vLLM does).
  - Admission allocates blocks for the whole prompt at once (vLLM `can_allocate`), keeping a
    1% watermark of free blocks; full blocks already in the cache are reused.
  - Hash-based full-block prefix cache, LRU eviction of unreferenced blocks (ties: deepest).
  - Recompute preemption of the last running request when a decode needs a block.
"""

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
