"""The batchllm policy's pool of blocks held once: blocks handed out and taken back in the order
BlockPool gives for blocks held once, lists freed in one go as one at a time, and double frees."""

import numpy as np
import pytest

from batchllm.sched.block_pool import BlockPool, OutOfBlocksError
from batchllm.sched.owned_block_pool import OwnedBlockPool


def test_hands_out_and_takes_back_blocks_as_the_reference_pool():
    owned, reference = OwnedBlockPool(12, 4), BlockPool(12, 4)
    for pool in (owned, reference):
        first, second, third = pool.allocate(3), pool.allocate(1), pool.allocate(4)
        pool.free(second)
        pool.free(first)
        assert pool.allocate(2) == [0, 1]  # the last freed on top
        pool.free(third)
    assert owned.allocate(6) == reference.allocate(6) == [4, 5, 6, 7, 2, 3]
    assert owned.num_free_blocks == reference.num_free_blocks == 4
    assert owned.num_used_blocks == 8 and [owned.ref_count(b) for b in (0, 7, 8)] == [1, 1, 0]
    assert owned.allocate_array(3).tolist() == [8, 9, 10] and owned.allocate(0) == []
    with pytest.raises(OutOfBlocksError, match="asked for 2 KV blocks, 1 free"):
        owned.allocate(2)


def test_a_release_of_lists_reversed_frees_as_each_list_in_turn():
    lists = [[5, 1, 3], [0], [], [7, 2]]
    bulk, single = OwnedBlockPool(9, 1), OwnedBlockPool(9, 1)
    for pool in (bulk, single):
        pool.allocate(9)
    bulk.release(np.array([block_id for block_ids in lists for block_id in reversed(block_ids)]))
    for block_ids in lists:
        single.free(block_ids)
    assert bulk.num_free_blocks == single.num_free_blocks == 6
    assert bulk.allocate(6) == single.allocate(6) == [7, 2, 0, 5, 1, 3]  # each list last first, the last list on top


def test_double_frees_are_refused():
    pool = OwnedBlockPool(4, 1)
    held = pool.allocate(3)
    with pytest.raises(ValueError, match="double free of KV block 3"):
        pool.free([3])
    with pytest.raises(ValueError, match="double free of KV block 1"):
        pool.free([1, 1])
    pool.free(held)
    with pytest.raises(ValueError, match="double free of KV block 2"):
        pool.release(np.array([2, 0]))


def test_a_block_named_twice_in_one_release_is_refused_and_nothing_is_freed():
    pool = OwnedBlockPool(4, 1)
    pool.allocate(3)
    with pytest.raises(ValueError, match="double free of KV block 0"):
        pool.release(np.array([2, 0, 0, 1]))
    assert pool.num_free_blocks == 1
    pool.release(np.array([2, 0, 1]))
    assert pool.allocate(4) == [1, 0, 2, 3]
