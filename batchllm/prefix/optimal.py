"""Exact optimal single-level grouping on the compact prefix tree (BatchLLM 4.2): the DP over
f(v, a) of docs/design.md ("Prefix planning"), one 2-D numpy array per tree level; ties choose
"not chosen", so a chosen node has >= 2 members and a group's prefix equals its members' LCP."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchllm.prefix.tree import CompactPrefixTree


# DP table entries (sum over nodes of their level) allowed: ~3 int64 tables -> ~1.2 GB.
MAX_TABLE_ENTRIES = 50_000_000


class PrefixTreeTooDeepError(ValueError):
    """The exact DP table would not fit in memory (prompts nested thousands of levels deep)."""


@dataclass(frozen=True)
class OptimalAssignment:
    saved_num_tokens: int  # the exact optimum of the objective
    request_group_node: np.ndarray  # [num_requests] int64: tree node of the request's group, -1 = singleton


def solve_optimal(tree: CompactPrefixTree, max_table_entries: int = MAX_TABLE_ENTRIES) -> OptimalAssignment:
    table_entries = int(tree.level.sum())
    if table_entries > max_table_entries:
        raise PrefixTreeTooDeepError(
            f"prefix tree too deep for the exact planner: {table_entries} DP entries "
            f"(limit {max_table_entries}); prompts are nested {int(tree.level.max())} levels deep"
        )
    levels = tree.nodes_by_level()  # levels[0] == [root]
    depth = tree.depth_num_tokens
    ends = tree.num_key_ends
    position = np.empty(tree.num_nodes, dtype=np.int64)  # index of a node within its level
    for nodes in levels:
        position[nodes] = np.arange(len(nodes))

    # Top-down: ancestor_depth[L][i, k] = depth of the level-k ancestor of node levels[L][i].
    ancestor_depth: list[np.ndarray] = [np.zeros((1, 0), dtype=np.int64)]
    for level in range(1, len(levels)):
        parents = tree.parent[levels[level]]
        above = ancestor_depth[level - 1][position[parents]]
        ancestor_depth.append(np.concatenate((above, depth[parents][:, None]), axis=1))

    # Bottom-up: value_not_chosen[L]: [n_L, L]; value_chosen[L]: [n_L].
    value_not_chosen: list[np.ndarray] = [None] * len(levels)  # type: ignore[list-item]
    value_chosen: list[np.ndarray] = [None] * len(levels)  # type: ignore[list-item]
    child_best: np.ndarray | None = None  # f of the level below, [n_{L+1}, L+1]
    for level in range(len(levels) - 1, -1, -1):
        nodes = levels[level]
        children_sum = np.zeros((len(nodes), level + 1), dtype=np.int64)
        if child_best is not None:
            np.add.at(children_sum, position[tree.parent[levels[level + 1]]], child_best)
        node_depth = depth[nodes]
        node_ends = ends[nodes]
        not_chosen = ancestor_depth[level] * node_ends[:, None] + children_sum[:, :level]
        chosen = node_depth * node_ends - node_depth + children_sum[:, level]
        value_not_chosen[level] = not_chosen
        value_chosen[level] = chosen
        child_best = np.maximum(not_chosen, chosen[:, None])
    # The root (depth 0) chosen or not gives the same value: its "group" shares nothing.
    saved = int(value_chosen[0][0])

    # Top-down decisions: chosen ancestor level and group node inherited along each path.
    group_node = np.full(tree.num_nodes, -1, dtype=np.int64)
    chosen_level = np.zeros(tree.num_nodes, dtype=np.int64)
    rows = np.arange(max((len(n) for n in levels), default=0))
    for level in range(1, len(levels)):
        nodes = levels[level]
        parents = tree.parent[nodes]
        inherited_level = chosen_level[parents]
        inherited_group = group_node[parents]
        not_chosen = value_not_chosen[level][rows[: len(nodes)], inherited_level]
        take = value_chosen[level] > not_chosen
        chosen_level[nodes] = np.where(take, level, inherited_level)
        group_node[nodes] = np.where(take, nodes, inherited_group)
    return OptimalAssignment(saved, group_node[tree.request_node])
