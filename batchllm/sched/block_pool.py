"""A pool of fixed-size KV blocks, identified by int ids (torch-free)."""

from __future__ import annotations


class OutOfBlocksError(RuntimeError):
    pass


class PoolSize:
    """What every pool of num_blocks blocks of block_size tokens answers."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size

    @property
    def num_free_blocks(self) -> int:
        raise NotImplementedError

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def check_request_fits(self, request_id: int, num_prompt_tokens: int, max_tokens: int) -> None:
        """Reject up front a request that could never run, even alone in the cache."""
        needed = self.blocks_for_tokens(num_prompt_tokens + max_tokens)
        if needed > self.num_blocks:
            raise ValueError(
                f"request {request_id} needs {needed} KV blocks at full length ({num_prompt_tokens} prompt + "
                f"{max_tokens} max_tokens), the cache has {self.num_blocks}"
            )


class BlockPool(PoolSize):
    """Free list of KV block ids 0 .. num_blocks-1 with reference counts: a block is free at 0;
    a shared block carries one reference per holder (a group, a cache entry)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        # Pop from the end: hand out low ids first (stable, readable block tables in tests).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._ref_counts: list[int] = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """num_blocks free blocks, each with one reference, in the order single pops would give."""
        free = self._free
        if num_blocks > len(free):
            raise OutOfBlocksError(f"asked for {num_blocks} KV blocks, {len(free)} free")
        if num_blocks == 1:
            block_id = free.pop()
            self._ref_counts[block_id] = 1
            return [block_id]
        if num_blocks <= 0:
            return []
        block_ids = free[-num_blocks:]
        del free[-num_blocks:]
        block_ids.reverse()
        ref_counts = self._ref_counts
        for block_id in block_ids:
            ref_counts[block_id] = 1
        return block_ids

    def incref(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise ValueError(f"incref of free block {block_id}")
            self._ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block (last first); blocks reaching 0 return to the free list."""
        for block_id in reversed(block_ids):
            count = self._ref_counts[block_id]
            if count <= 0:
                raise ValueError(f"double free of KV block {block_id}")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free.append(block_id)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]
