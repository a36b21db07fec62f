"""Compact prefix tree over request keys (BatchLLM 4.2): nodes are the depths where keys branch or
end. Built in one pass with a stack over sorted keys and neighbour LCPs (like a Cartesian tree):
O(num_requests) Python steps on plain ints, no dict per token, so 1M requests fit."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchllm.prefix.keys import SortedKeys


@dataclass(frozen=True)
class CompactPrefixTree:
    """Node 0 is the root (depth 0). Arrays are indexed by node id."""

    depth_num_tokens: np.ndarray  # [num_nodes] int64: key tokens from the root to the node
    parent: np.ndarray  # [num_nodes] int64, -1 for the root
    num_key_ends: np.ndarray  # [num_nodes] int64: keys that end exactly at the node
    level: np.ndarray  # [num_nodes] int64: number of ancestors (root = 0)
    request_node: np.ndarray  # [num_requests] int64: node where each request's key ends

    @property
    def num_nodes(self) -> int:
        return len(self.parent)

    def nodes_by_level(self) -> list[np.ndarray]:
        """Node ids per level, ascending ids within a level."""
        order = np.argsort(self.level, kind="stable")
        bounds = np.searchsorted(self.level[order], np.arange(int(self.level.max()) + 2))
        return [order[bounds[i] : bounds[i + 1]] for i in range(len(bounds) - 1)]

    def subtree_num_keys(self) -> np.ndarray:
        """[num_nodes] keys ending in each node's subtree."""
        counts = self.num_key_ends.copy()
        for nodes in reversed(self.nodes_by_level()[1:]):
            np.add.at(counts, self.parent[nodes], counts[nodes])
        return counts


def build_tree(keys: SortedKeys) -> CompactPrefixTree:
    """Stack construction over keys in sorted order."""
    lcp = keys.lcp_num_tokens.tolist()
    key_len = keys.key_num_tokens.tolist()
    depth = [0]
    parent = [-1]
    ends = [0]
    sorted_node = [0] * len(key_len)
    stack = [0]  # node ids on the root path of the previous key, depths increasing
    for i, (shared, length) in enumerate(zip(lcp, key_len)):
        # Close nodes deeper than the part shared with the previous key.
        while depth[stack[-1]] > shared:
            closed = stack.pop()
            if depth[stack[-1]] >= shared:
                parent[closed] = stack[-1]
            else:  # the branch point is inside an edge: split it with a new node
                parent[closed] = len(depth)
                stack.append(len(depth))
                depth.append(shared)
                parent.append(-1)
                ends.append(0)
        # Now depth[stack[-1]] == shared <= length.
        if length > shared:
            stack.append(len(depth))
            depth.append(length)
            parent.append(-1)
            ends.append(0)
        top = stack[-1]
        ends[top] += 1
        sorted_node[i] = top
    for below, above in zip(stack[1:], stack[:-1]):
        parent[below] = above

    parent_array = np.asarray(parent, dtype=np.int64)
    request_node = np.empty(len(key_len), dtype=np.int64)
    request_node[keys.order] = np.asarray(sorted_node, dtype=np.int64)
    return CompactPrefixTree(
        depth_num_tokens=np.asarray(depth, dtype=np.int64),
        parent=parent_array,
        num_key_ends=np.asarray(ends, dtype=np.int64),
        level=_levels(parent_array, np.asarray(depth, dtype=np.int64)),
        request_node=request_node,
    )


def _levels(parent: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """Number of ancestors per node; parents are visited before children (smaller depth)."""
    level = np.zeros(len(parent), dtype=np.int64)
    by_depth = np.argsort(depth, kind="stable")[1:]  # skip the root (the only depth-0 node)
    # Process in waves of equal depth: a parent is strictly shallower than its child.
    sorted_depth = depth[by_depth]
    bounds = np.flatnonzero(np.diff(sorted_depth)) + 1
    for nodes in np.split(by_depth, bounds):
        level[nodes] = level[parent[nodes]] + 1
    return level
