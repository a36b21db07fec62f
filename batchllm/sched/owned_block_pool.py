"""A pool of KV blocks each held by one owner at a time (no reference counts), kept in arrays:
the batchllm policy's pool, whose steps take and return hundreds of blocks (a Python loop over
them cost ~0.2 us a block). Torch-free."""

from __future__ import annotations

import numpy as np

from batchllm.sched.block_pool import OutOfBlocksError, PoolSize


class OwnedBlockPool(PoolSize):
    """Free list of KV block ids 0 .. num_blocks-1, each block free or held once. It hands out and
    takes back blocks in the order BlockPool does for blocks held once: low ids first, and a
    freed list's first block on top."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self._free = np.arange(num_blocks - 1, -1, -1, dtype=np.int64)  # a stack, top at _num_free - 1
        self._num_free = num_blocks
        self._held = np.zeros(num_blocks, dtype=bool)
        # For each block, the place of the last entry naming it in the latest release (finds a
        # block released twice in one go without a Python set).
        self._release_place = np.zeros(num_blocks, dtype=np.int64)

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    def allocate(self, num_blocks: int) -> list[int]:
        """num_blocks free blocks, in the order single pops would give."""
        return self.allocate_array(num_blocks).tolist()

    def allocate_array(self, num_blocks: int) -> np.ndarray:
        """allocate(num_blocks) as a new int64 array."""
        top = self._num_free
        if num_blocks > top:
            raise OutOfBlocksError(f"asked for {num_blocks} KV blocks, {top} free")
        if num_blocks <= 0:
            return np.zeros(0, dtype=np.int64)
        block_ids = self._free[top - num_blocks:top][::-1].copy()
        self._num_free = top - num_blocks
        self._held[block_ids] = True
        return block_ids

    def free(self, block_ids: list[int] | np.ndarray) -> None:
        """Return the blocks, the last one first (the first one ends on top)."""
        if len(block_ids):
            self.release(np.asarray(block_ids, dtype=np.int64)[::-1])

    def release(self, block_ids: np.ndarray) -> None:
        """Return the blocks in this order (the last one ends on top), in one go: free() of
        several lists in turn is the release of each list reversed, one after the other."""
        if not block_ids.shape[0]:
            return
        held = self._held[block_ids]
        if not held.all() or self._has_repeats(block_ids):
            seen: set[int] = set()
            for block_id, was_held in zip(block_ids.tolist(), held.tolist()):
                if not was_held or block_id in seen:
                    raise ValueError(f"double free of KV block {block_id}")
                seen.add(block_id)
        self._held[block_ids] = False
        top = self._num_free
        self._free[top:top + block_ids.shape[0]] = block_ids
        self._num_free = top + block_ids.shape[0]

    def _has_repeats(self, ids: np.ndarray) -> bool:
        """Whether a block id appears more than once in ids."""
        places = np.arange(ids.shape[0])
        self._release_place[ids] = places  # the last of equal ids wins
        return bool((self._release_place[ids] != places).any())

    def ref_count(self, block_id: int) -> int:
        """1 while the block is held, else 0."""
        return int(self._held[block_id])
