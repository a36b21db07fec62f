"""`sglang` baseline: SGLang's scheduler (v0.3/v0.4 defaults) on this engine's BlockPool; what it
reproduces (lpm order, unmixed prefill/decode steps, PrefillAdder reservation, retract_decode) is
listed in docs/design.md ("Scheduling")."""

from __future__ import annotations

from batchllm.sched.config import SchedulerConfig
from batchllm.sched.interface import SchedulerOutput
from batchllm.sched.policies.cached_base import CachedPolicyBase, CachedSeq

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.14
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600
CLIP_MAX_NEW_TOKENS = 4096
RETRACT_DECODE_STEPS = 20


class SglangScheduler(CachedPolicyBase):
    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config, leaf_only_eviction=True)
        self.max_running_requests = config.max_num_seqs
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.chunked: CachedSeq | None = None  # the one request whose prefill is split

    def schedule(self) -> SchedulerOutput:
        if self.chunked is not None or self.waiting:
            scheduled = self._prefill_batch()
            if scheduled:
                return self.build_output(scheduled, [])
        return self._decode_batch()

    def _prefill_batch(self) -> list[tuple[CachedSeq, int]]:
        budget = self.config.max_num_batched_tokens
        size = self.pool.block_size
        scheduled: list[tuple[CachedSeq, int]] = []
        decoding = [s for s in self.running if s is not self.chunked]
        reserved_tokens = sum(
            (s.request.max_tokens - s.num_outputs) * self.new_token_ratio for s in decoding
        )
        if self.chunked is not None:
            seq = self.chunked
            num_tokens = min(seq.num_pending_tokens, budget)
            if not self.grow(seq, num_tokens):
                return []  # decode until memory frees up
            scheduled.append((seq, num_tokens))
            budget -= num_tokens
            reserved_tokens += seq.num_pending_tokens - num_tokens + seq.request.max_tokens
            if num_tokens < seq.num_pending_tokens:
                return scheduled  # still not done: at most one chunked request
            self.chunked = None  # its last chunk runs now; it decodes from the next step
            if budget <= 0:
                return scheduled
        # Longest prefix match first (stable: input order among equals). Each request matches
        # again when admitted: admitting the ones before it may have evicted blocks it matched.
        match_lengths = {id(seq): len(self.match_cached(seq)) for seq in self.waiting}
        order = sorted(self.waiting, key=lambda s: -match_lengths[id(s)])
        admitted: list[CachedSeq] = []
        for seq in order:
            if budget <= 0:
                break
            if self.max_running_requests is not None and len(self.running) >= self.max_running_requests:
                break
            nodes = self.match_cached(seq)
            extend_tokens = seq.num_own_tokens - len(nodes) * size
            remaining_new = seq.request.max_tokens - seq.num_outputs
            need_tokens = extend_tokens + min(max(remaining_new, 0), CLIP_MAX_NEW_TOKENS)
            available = self.num_available_blocks(nodes)
            if need_tokens > available * size - reserved_tokens and (self.running or admitted):
                break  # SGLang stops at the first request that does not fit
            num_tokens = min(extend_tokens, budget)
            blocks_needed = self.pool.blocks_for_tokens(len(nodes) * size + num_tokens) - len(nodes)
            if blocks_needed > available:
                break
            self.start_with_cached(seq, nodes)
            seq.block_ids.extend(self.allocate(blocks_needed))
            admitted.append(seq)
            self.running.append(seq)
            scheduled.append((seq, num_tokens))
            budget -= num_tokens
            reserved_tokens += need_tokens
            if num_tokens < extend_tokens:
                self.chunked = seq
                break
        if admitted:
            admitted_ids = {id(s) for s in admitted}
            self.waiting = type(self.waiting)(s for s in self.waiting if id(s) not in admitted_ids)
        return scheduled

    def _decode_batch(self) -> SchedulerOutput:
        preempted: list[int] = []
        batch = [s for s in self.running if s is not self.chunked and s.num_pending_tokens > 0]
        needed = sum(
            self.pool.blocks_for_tokens(s.num_computed_tokens + s.num_pending_tokens) - len(s.block_ids) for s in batch
        )
        if needed > self.num_available_blocks() and len(batch) > 1:
            # SGLang retract_decode: drop the requests with the fewest outputs first.
            batch.sort(key=lambda s: (s.num_outputs, -s.request.num_prompt_tokens), reverse=True)
            while needed > self.num_available_blocks() and len(batch) > 1:
                victim = batch.pop()
                needed -= self.pool.blocks_for_tokens(victim.num_own_tokens) - len(victim.block_ids)
                self.preempt(victim, preempted)
            total_decoded = sum(s.num_outputs for s in batch)
            total_max_new = sum(s.request.max_tokens for s in batch) or 1
            self.new_token_ratio = min(1.0, (total_decoded + RETRACT_DECODE_STEPS * len(batch)) / total_max_new)
            position = {id(s): i for i, s in enumerate(self.running)}
            batch.sort(key=lambda s: position[id(s)])
        else:
            self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)
        scheduled = []
        for seq in batch:
            num_tokens = seq.num_pending_tokens
            if not self.grow(seq, num_tokens):
                raise AssertionError("decode allocation failed after retraction")
            scheduled.append((seq, num_tokens))
        return self.build_output(scheduled, preempted)
