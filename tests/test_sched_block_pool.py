"""The block pool: bulk allocation in the order single pops give, reference counts, frees of
blocks held once and of shared ones, and the errors."""

import pytest

from batchllm.sched.block_pool import BlockPool, OutOfBlocksError


def test_allocate_in_bulk_as_one_at_a_time():
    bulk, single = BlockPool(10, 4), BlockPool(10, 4)
    assert bulk.allocate(3) == [0, 1, 2] == [single.allocate(1)[0] for _ in range(3)]
    assert bulk.allocate(0) == [] and bulk.num_free_blocks == 7
    with pytest.raises(OutOfBlocksError, match="asked for 8 KV blocks, 7 free"):
        bulk.allocate(8)
    assert [bulk.ref_count(b) for b in range(4)] == [1, 1, 1, 0]


def test_free_returns_blocks_last_first_and_keeps_shared_ones():
    pool = BlockPool(6, 1)
    own = pool.allocate(3)  # [0, 1, 2]
    shared = pool.allocate(2)  # [3, 4]
    pool.incref([3])
    pool.free(own)  # every block held once: all freed, the last one on top
    assert pool.allocate(3) == [0, 1, 2]
    pool.free(shared)  # block 3 keeps a reference: only block 4 returns
    assert (pool.ref_count(3), pool.ref_count(4), pool.num_free_blocks) == (1, 0, 2)
    assert pool.allocate(2) == [4, 5]
    pool.free([])
    with pytest.raises(ValueError, match="double free of KV block 4"):
        pool.free([4, 4])
    with pytest.raises(ValueError, match="double free of KV block 1"):
        pool.free([0, 1]) or pool.free([1])
