"""Content-addressed cache of full KV blocks with LRU eviction for the vllm / sglang baselines: the
block-level radix tree and its two eviction rules (`leaf_only`: SGLang's) are described in
docs/design.md ("Scheduling")."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from batchllm.sched.block_pool import BlockPool

ROOT_NODE_ID = 0


@dataclass
class CacheNode:
    node_id: int
    key: tuple[int, tuple[int, ...]]  # (parent node id, token ids of this block)
    block_id: int
    parent: "CacheNode | None"
    depth_num_blocks: int  # 1 for a block at position 0
    num_children: int = 0
    last_access: int = 0
    stamp: int = 0  # bumped on every touch: stale heap entries are skipped
    alive: bool = True


class BlockPrefixCache:
    def __init__(self, pool: BlockPool, leaf_only: bool) -> None:
        self.pool = pool
        self.leaf_only = leaf_only
        self._nodes: dict[tuple[int, tuple[int, ...]], CacheNode] = {}
        # (last_access, -depth, stamp, node_id, node): node_id is unique, nodes are never compared
        self._heap: list[tuple[int, int, int, int, CacheNode]] = []
        self._by_block: dict[int, CacheNode] = {}  # a block is cached under at most one node
        self._clock = 0
        self._next_node_id = ROOT_NODE_ID + 1
        self.num_evictable_blocks = 0

    def tick(self) -> int:
        self._clock += 1
        return self._clock

    def match(self, token_ids: list[int], max_num_blocks: int) -> list[CacheNode]:
        """Longest chain of cached full blocks that is a prefix of token_ids."""
        size = self.pool.block_size
        nodes: list[CacheNode] = []
        parent_id = ROOT_NODE_ID
        for index in range(min(max_num_blocks, len(token_ids) // size)):
            node = self._nodes.get((parent_id, tuple(token_ids[index * size:(index + 1) * size])))
            if node is None:
                break
            nodes.append(node)
            parent_id = node.node_id
        return nodes

    def has_first_block(self, token_ids: tuple[int, ...]) -> bool:
        return (ROOT_NODE_ID, token_ids) in self._nodes

    def num_evictable_in(self, nodes: Sequence[CacheNode]) -> int:
        return sum(1 for node in nodes if self.pool.ref_count(node.block_id) == 1)

    def acquire(self, nodes: list[CacheNode]) -> list[int]:
        """Take a request's reference on matched blocks (they stop being evictable)."""
        now = self.tick()
        for node in nodes:
            if self.pool.ref_count(node.block_id) == 1:
                self.num_evictable_blocks -= 1
            node.last_access = now
            node.stamp += 1
        block_ids = [node.block_id for node in nodes]
        self.pool.incref(block_ids)
        return block_ids

    def insert(self, parent: CacheNode | None, token_ids: tuple[int, ...], block_id: int) -> CacheNode:
        """Cache a request's freshly computed full block; returns the node now holding that
        content (an existing node when another request cached the same content first: the
        request's own block then simply stays uncached)."""
        key = (parent.node_id if parent is not None else ROOT_NODE_ID, token_ids)
        node = self._nodes.get(key)
        if node is not None:
            return node
        node = CacheNode(
            node_id=self._next_node_id,
            key=key,
            block_id=block_id,
            parent=parent,
            depth_num_blocks=(parent.depth_num_blocks if parent is not None else 0) + 1,
            last_access=self._clock,
        )
        self._next_node_id += 1
        self._nodes[key] = node
        self._by_block[block_id] = node
        if parent is not None:
            parent.num_children += 1
        self.pool.incref([block_id])  # the cache's own reference
        return node

    def release(self, block_ids: list[int]) -> None:
        """Drop a request's references; cached blocks left with only the cache's reference
        become evictable, stamped with this access time (vLLM/SGLang: last use = release)."""
        now = self.tick()
        self.pool.free(block_ids)
        for block_id in block_ids:
            if self.pool.ref_count(block_id) != 1:
                continue
            node = self._by_block.get(block_id)
            if node is None:
                continue
            node.last_access = now
            node.stamp += 1
            self.num_evictable_blocks += 1
            self._push(node)

    def evict_one(self) -> bool:
        while self._heap:
            _, _, stamp, _, node = heapq.heappop(self._heap)
            if not node.alive or node.stamp != stamp or self.pool.ref_count(node.block_id) != 1:
                continue
            if self.leaf_only and node.num_children > 0:
                continue  # re-pushed when its last child is evicted
            self._remove(node)
            return True
        return False

    def clear(self) -> None:
        """Free every cached block nobody else holds (end of a batch)."""
        while self.evict_one():
            pass

    def _push(self, node: CacheNode) -> None:
        heapq.heappush(self._heap, (node.last_access, -node.depth_num_blocks, node.stamp, node.node_id, node))

    def _remove(self, node: CacheNode) -> None:
        node.alive = False
        del self._nodes[node.key]
        del self._by_block[node.block_id]
        self.num_evictable_blocks -= 1
        self.pool.free([node.block_id])
        parent = node.parent
        if parent is not None and parent.alive:
            parent.num_children -= 1
            if self.leaf_only and parent.num_children == 0 and self.pool.ref_count(parent.block_id) == 1:
                self._push(parent)
