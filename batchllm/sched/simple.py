"""`simple` policy: FCFS continuous batching with chunked prefill, no prefix sharing.

The plainest policy that satisfies the Scheduler contract, and a reference the other policies
are tested against (greedy outputs must be identical under every policy). Its per-request state
is the baselines' CachedSeq, without a prefix cache.
"""

from __future__ import annotations

from collections import deque

from batchllm.sched.block_pool import BlockPool
from batchllm.sched.config import SchedulerConfig
from batchllm.sched.interface import FinishedRequest, ScheduledChunk, SchedRequest, SchedulerOutput
from batchllm.sched.policies.cached_base import CachedSeq, token_slice


class SimpleScheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.pool = BlockPool(config.num_kv_blocks, config.block_size)
        self.waiting: deque[CachedSeq] = deque()
        self.running: list[CachedSeq] = []
        self.step_index = 0
        self.num_preemptions = 0

    def add_requests(self, requests: list[SchedRequest]) -> None:
        for request in requests:
            self.pool.check_request_fits(request.request_id, request.num_prompt_tokens, request.max_tokens)
            self.waiting.append(CachedSeq(request))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[CachedSeq, int]] = []
        preempted: list[int] = []
        # Running requests first, in admission order; preempt from the back when out of blocks.
        index = 0
        while index < len(self.running) and budget > 0:
            state = self.running[index]
            num_tokens = min(state.num_pending_tokens, budget)
            if not self._grow(state, num_tokens):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request.request_id)
                if victim is state:
                    break
                continue
            scheduled.append((state, num_tokens))
            budget -= num_tokens
            index += 1
        # Then admit waiting requests in FCFS order.
        max_seqs = self.config.max_num_seqs
        while self.waiting and budget > 0 and not preempted:
            if max_seqs is not None and len(self.running) >= max_seqs:
                break
            state = self.waiting[0]
            num_tokens = min(state.num_pending_tokens, budget)
            if not self._grow(state, num_tokens):
                break
            self.waiting.popleft()
            self.running.append(state)
            scheduled.append((state, num_tokens))
            budget -= num_tokens
        return self._build_output(scheduled, preempted)

    def update(
        self,
        output: SchedulerOutput,
        sampled_token_ids: dict[int, int],
        finish_reasons: dict[int, str],
    ) -> list[FinishedRequest]:
        by_id = {state.request.request_id: state for state in self.running}
        finished: list[FinishedRequest] = []
        for chunk in output.chunks:
            state = by_id[chunk.seq_id]
            state.num_computed_tokens += chunk.num_tokens
            if chunk.sample:
                state.request.output_token_ids.append(sampled_token_ids[chunk.seq_id])
            reason = finish_reasons.get(chunk.seq_id)
            if reason is not None:
                self.pool.free(state.block_ids)
                state.block_ids = []
                self.running.remove(state)
                finished.append(
                    FinishedRequest(chunk.seq_id, tuple(state.request.output_token_ids), reason)
                )
        self.step_index += 1
        return finished

    # -- helpers -------------------------------------------------------------------------

    def _grow(self, state: CachedSeq, num_tokens: int) -> bool:
        needed = self.pool.blocks_for_tokens(state.num_computed_tokens + num_tokens) - len(state.block_ids)
        if needed <= 0:
            return True
        if not self.pool.can_allocate(needed):
            return False
        state.block_ids.extend(self.pool.allocate(needed))
        return True

    def _preempt(self, state: CachedSeq) -> None:
        # Recompute later: free the KV, keep the generated tokens (they are re-prefilled).
        self.pool.free(state.block_ids)
        state.block_ids = []
        state.num_computed_tokens = 0
        self.waiting.appendleft(state)
        self.num_preemptions += 1

    def _build_output(self, scheduled: list[tuple[CachedSeq, int]], preempted: list[int]) -> SchedulerOutput:
        chunks = []
        for state, num_tokens in scheduled:
            start = state.num_computed_tokens
            chunks.append(
                ScheduledChunk(
                    seq_id=state.request.request_id,
                    token_ids=token_slice(state.request, start, start + num_tokens),
                    start_position=start,
                    block_ids=tuple(state.block_ids),
                    sample=start + num_tokens == state.num_total_tokens,
                    is_decode=state.is_decoding,
                )
            )
        return SchedulerOutput.from_chunks(self.step_index, chunks, len(self.running), self.pool.num_used_blocks,
                                           preempted)
