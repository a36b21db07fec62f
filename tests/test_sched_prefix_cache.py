"""Block prefix cache (vllm: LRU over blocks; sglang: LRU over radix leaves) and the factory."""

from __future__ import annotations

import pytest

from batchllm.sched.block_pool import BlockPool
from batchllm.sched.config import SchedulerConfig
from batchllm.sched.factory import make_scheduler
from batchllm.sched.prefix_cache import BlockPrefixCache


def _cache_chain(cache: BlockPrefixCache, pool: BlockPool, token_ids: list[int]) -> list[int]:
    """A request computes token_ids, caches its full blocks, then finishes."""
    size = pool.block_size
    block_ids = pool.allocate(len(token_ids) // size)
    parent = None
    for index, block_id in enumerate(block_ids):
        parent = cache.insert(parent, tuple(token_ids[index * size:(index + 1) * size]), block_id)
    cache.release(block_ids)
    return block_ids


@pytest.mark.parametrize("leaf_only", [False, True])
def test_hit_then_lru_eviction(leaf_only):
    pool = BlockPool(8, 2)
    cache = BlockPrefixCache(pool, leaf_only)
    old = _cache_chain(cache, pool, [1, 2, 3, 4, 5, 6])  # 3 blocks, older
    _cache_chain(cache, pool, [9, 9, 8, 8])  # 2 blocks, newer
    assert pool.num_free_blocks == 3 and cache.num_evictable_blocks == 5
    hit = cache.match([1, 2, 3, 4, 7, 7], max_num_blocks=3)
    assert [n.block_id for n in hit] == old[:2]
    # Oldest chain goes first, deepest block first: its tail, then its head.
    assert cache.evict_one()
    assert pool.ref_count(old[2]) == 0
    assert [n.block_id for n in cache.match([1, 2, 3, 4, 5, 6], 3)] == old[:2]
    held = cache.acquire(cache.match([1, 2, 3, 4], 2))  # a request holds the old head now
    assert cache.num_evictable_blocks == 2
    assert cache.evict_one() and cache.evict_one()  # the newer chain: nothing else is free
    assert not cache.evict_one()
    cache.release(held)
    cache.clear()
    assert pool.num_free_blocks == pool.num_blocks


def test_leaf_only_never_evicts_an_inner_node_first():
    pool = BlockPool(8, 1)
    cache = BlockPrefixCache(pool, leaf_only=True)
    _cache_chain(cache, pool, [1, 2])
    _cache_chain(cache, pool, [1, 3])  # shares node [1]; [3] is a newer leaf
    nodes = cache.match([1, 2], 2)
    assert len(nodes) == 2
    # Touch the root-side node [1] so it is the most recent; leaf [2] is then evicted first.
    cache.release(cache.acquire(nodes[:1]))
    assert cache.evict_one()
    assert len(cache.match([1, 2], 2)) == 1 and len(cache.match([1, 3], 2)) == 2


@pytest.mark.parametrize("policy,name", [("batchllm", "BatchLLMScheduler"), ("vllm", "VllmScheduler"),
                                         ("sglang", "SglangScheduler"), ("simple", "SimpleScheduler")])
def test_factory(policy, name):
    assert type(make_scheduler(SchedulerConfig(policy=policy))).__name__ == name


def test_vllm_defaults_and_request_cap():
    sched = make_scheduler(SchedulerConfig(policy="vllm"))
    assert sched.max_num_seqs == 256
    assert make_scheduler(SchedulerConfig(policy="vllm", max_num_seqs=1024, max_num_batched_tokens=16384)).max_num_seqs == 1024
