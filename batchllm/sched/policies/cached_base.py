"""Shared machinery of the per-request baselines (vllm, sglang): a request's KV = cached full
prefix blocks (reused from the LRU prefix cache, at the front of block_ids) + blocks it
computes itself; shared_kv_len is always 0, start_position = tokens already in the cache."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from batchllm.sched.config import SchedulerConfig
from batchllm.sched.interface import ChunksBuilder, SchedRequest, SchedulerOutput
from batchllm.sched.prefix_cache import BlockPrefixCache, CacheNode
from batchllm.sched.seq_state import PolicyBase, SeqState


@dataclass(eq=False)
class CachedSeq(SeqState):
    # Cache node of each leading full block (the chain used to key the next block).
    nodes: list[CacheNode] = field(default_factory=list)
    num_cached_prompt_tokens: int | None = None  # prompt tokens reused at first admission
    first_block_token_ids: tuple[int, ...] | None = None  # memo: cheap cache-miss test


class CachedPolicyBase(PolicyBase):
    """Block allocation through the prefix cache, recompute preemption and the end of a request."""

    def __init__(self, config: SchedulerConfig, leaf_only_eviction: bool) -> None:
        super().__init__(config)
        self.cache = BlockPrefixCache(self.pool, leaf_only_eviction) if config.enable_prefix_caching else None
        self.waiting: deque[CachedSeq] = deque()
        self.running: list[CachedSeq] = []

    def add_requests(self, requests: list[SchedRequest]) -> None:
        for request in requests:
            self.pool.check_request_fits(request.request_id, request.num_prompt_tokens, request.max_tokens)
            seq = self._seqs[request.request_id] = CachedSeq(request)
            self.waiting.append(seq)

    def _finish(self, seq: CachedSeq) -> int:
        self._release(seq)
        self.running.remove(seq)
        if not self._seqs and self.cache is not None:
            self.cache.clear()  # end of the batch: no block outlives it
        return seq.num_cached_prompt_tokens or 0

    def num_available_blocks(self, nodes: Sequence[CacheNode] = ()) -> int:
        """Free blocks + cached blocks nobody holds, less those among `nodes` (about to be held)."""
        if self.cache is None:
            return self.pool.num_free_blocks
        evictable = self.cache.num_evictable_blocks - self.cache.num_evictable_in(nodes)
        return self.pool.num_free_blocks + evictable

    def match_cached(self, seq: CachedSeq) -> list[CacheNode]:
        if self.cache is None or not seq.request.share_prefix:
            return []
        request = seq.request
        if seq.first_block_token_ids is None:
            seq.first_block_token_ids = tuple(request.prompt_token_ids[: self.pool.block_size])
        if not self.cache.has_first_block(seq.first_block_token_ids):
            return []  # most waiting requests of a big batch: one dict lookup, no slicing
        # The ids read so far (a waiting request has none in flight: it was not in the last step).
        token_ids = request.prompt_token_ids + request.output_token_ids if seq.num_outputs else request.prompt_token_ids
        # Keep >= 1 token to compute: its logits give the next token.
        return self.cache.match(token_ids, (seq.num_own_tokens - 1) // self.pool.block_size)

    def start_with_cached(self, seq: CachedSeq, nodes: list[CacheNode]) -> None:
        """(Re)admit: take references on the cached prefix blocks, skip their tokens."""
        seq.block_ids = self.cache.acquire(nodes) if nodes else []
        seq.nodes = list(nodes)
        seq.num_computed_tokens = len(nodes) * self.pool.block_size
        if seq.num_cached_prompt_tokens is None:
            seq.num_cached_prompt_tokens = min(seq.num_computed_tokens, seq.request.num_prompt_tokens)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Free blocks first, then evict LRU cached blocks nobody holds."""
        if num_blocks > self.num_available_blocks():
            return None
        while self.pool.num_free_blocks < num_blocks:
            if not self.cache.evict_one():
                raise AssertionError("prefix cache evictable count out of sync")
        return self.pool.allocate(num_blocks)

    def grow(self, seq: CachedSeq, num_tokens: int) -> bool:
        needed = self.pool.blocks_for_tokens(seq.num_computed_tokens + num_tokens) - len(seq.block_ids)
        if needed <= 0:
            return True
        block_ids = self.allocate(needed)
        if block_ids is None:
            return False
        seq.block_ids.extend(block_ids)
        return True

    def preempt(self, seq: CachedSeq, preempted: list[int]) -> None:
        """Recompute preemption: off the running list, the KV freed (full blocks stay cached),
        the outputs kept; back to the head of the waiting queue; its id appended to `preempted`."""
        self.running.remove(seq)
        self._release(seq)
        self.waiting.appendleft(seq)
        preempted.append(seq.request.request_id)

    def schedule_running(self, candidates: list[CachedSeq], budget: int
                         ) -> tuple[list[tuple[CachedSeq, int]], list[int], int]:
        """Chunks for running requests in the order of `candidates`, within the token budget; when
        blocks run out, the last running request not scheduled yet is preempted (recompute).
        Returns (scheduled, preempted ids, budget left)."""
        scheduled: list[tuple[CachedSeq, int]] = []
        scheduled_ids: set[int] = set()
        preempted: list[int] = []
        for seq in candidates:
            if budget <= 0:
                break
            if seq.request.request_id in preempted:
                continue
            num_tokens = min(seq.num_pending_tokens, budget)
            while not self.grow(seq, num_tokens):  # seq itself is a candidate victim: never stuck
                victim = next(s for s in reversed(self.running) if s.request.request_id not in scheduled_ids)
                self.preempt(victim, preempted)
                if victim is seq:
                    break
            if seq.request.request_id in preempted:
                continue
            scheduled.append((seq, num_tokens))
            scheduled_ids.add(seq.request.request_id)
            budget -= num_tokens
        return scheduled, preempted, budget

    def build_output(self, scheduled: list[tuple[CachedSeq, int]], preempted: list[int]) -> SchedulerOutput:
        builder = ChunksBuilder()
        for seq, num_tokens in scheduled:
            seq.chunk(builder, num_tokens)
        finished, self.finished_seq_ids = self.finished_seq_ids, []
        # Blocks some request holds: cached blocks nobody holds are free memory.
        num_active_blocks = self.pool.num_blocks - self.num_available_blocks()
        return SchedulerOutput.from_chunks(self.step_index, builder.build(), len(self.running), num_active_blocks,
                                           preempted, finished)

    def _release(self, seq: CachedSeq) -> None:
        block_ids = seq.drop_blocks()
        if self.cache is not None:
            self.cache.release(block_ids)
        else:
            self.pool.free(block_ids)
        seq.nodes = []

    def _stored(self, seq: CachedSeq) -> None:
        """Register blocks that just became full (prompt and generated tokens alike, as
        vLLM v0.6 and SGLang do), so later requests and recomputation can hit them."""
        if self.cache is None:
            return
        size = self.pool.block_size
        num_full = seq.num_computed_tokens // size
        if len(seq.nodes) >= num_full:
            return
        for index in range(len(seq.nodes), num_full):
            block_token_ids = seq.token_ids(index * size, (index + 1) * size)
            parent = seq.nodes[index - 1] if index else None
            own_block_id = seq.block_ids[index]
            node = self.cache.insert(parent, block_token_ids, own_block_id)
            if node.block_id != own_block_id:
                # Same content already cached (computed concurrently): switch to the cached
                # block and free the duplicate, as vLLM v0.6 (promote_to_immutable) and SGLang
                # (radix insert) do. Keeps "holding a node => holding its ancestors".
                self.cache.acquire([node])
                self.pool.free([own_block_id])
                seq.replace_block(index, node.block_id)
            seq.nodes.append(node)
