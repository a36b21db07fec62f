"""Global prefix planner: prompts -> optimal single-level prefix-sharing groups (BatchLLM 4.2),
through keys.py, tree.py, optimal.py, groups.py and stats.py (docs/design.md). Torch-free."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from operator import itemgetter
from typing import Sequence

import numpy as np

from batchllm.prefix.groups import PrefixGroup, PrefixPlan
from batchllm.prefix.keys import sort_keys
from batchllm.prefix.optimal import solve_optimal
from batchllm.prefix.stats import PlanStats, build_stats
from batchllm.prefix.tree import build_tree

# Token ids below this are turned into shared int objects (8 bytes per token in tuples
# instead of ~36), which keeps a 1M-request plan within a few GB.
_INTERN_MAX_TOKEN_ID = 1 << 20


@dataclass(frozen=True)
class PlanArrays:
    """The plan as arrays (no per-token Python objects): enough for schedulers and stats."""

    group_start: np.ndarray  # [num_groups + 1] int64: offsets into member_request_index
    member_request_index: np.ndarray  # [num_requests] int64: requests grouped, ascending per group
    group_prefix_num_tokens: np.ndarray  # [num_groups] int64 (0 for singletons)
    stats: PlanStats
    max_token_id: int

    @property
    def group_sizes(self) -> np.ndarray:
        return np.diff(self.group_start)


def _plan_arrays(prompts: Sequence[Sequence[int]], started: float) -> tuple[PlanArrays, list[np.ndarray]]:
    keys, arrays = sort_keys(prompts)
    num_requests = len(arrays)
    tree = build_tree(keys)
    assignment = solve_optimal(tree)
    group_node = assignment.request_group_node
    # Singletons get a unique key past every node id; sorting groups members ascending.
    request_index = np.arange(num_requests, dtype=np.int64)
    group_key = np.where(group_node >= 0, group_node, tree.num_nodes + request_index)
    members = np.argsort(group_key, kind="stable")
    sorted_key = group_key[members]
    is_first = np.ones(num_requests, dtype=bool)
    is_first[1:] = sorted_key[1:] != sorted_key[:-1]
    starts = np.flatnonzero(is_first)
    # Order groups by their smallest request index (stable, readable output).
    group_order = np.argsort(members[starts], kind="stable")
    sizes = np.diff(np.append(starts, num_requests))[group_order]
    # Move each group's block of members to its new place (vectorised).
    block_start = starts[group_order]
    group_start = np.concatenate(([0], np.cumsum(sizes)))
    offset_in_block = np.arange(num_requests, dtype=np.int64) - np.repeat(group_start[:-1], sizes)
    new_members = members[np.repeat(block_start, sizes) + offset_in_block]
    first_node = group_node[new_members[group_start[:-1]]]
    prefix_num_tokens = np.where(first_node >= 0, tree.depth_num_tokens[np.maximum(first_node, 0)], 0)
    prefix_num_tokens = np.where(sizes >= 2, prefix_num_tokens, 0)
    check = int(((sizes - 1) * prefix_num_tokens).sum())
    assert check == assignment.saved_num_tokens, (check, assignment.saved_num_tokens)
    seconds = time.perf_counter() - started
    stats = build_stats(tree, keys.prompt_num_tokens, assignment.saved_num_tokens, sizes, prefix_num_tokens, seconds)
    return PlanArrays(group_start, new_members, prefix_num_tokens, stats, keys.max_token_id), arrays


def plan_prefix_arrays(prompts: Sequence[Sequence[int]]) -> PlanArrays:
    """The optimal plan as arrays (fast path for very large batches and for schedulers)."""
    return _plan_arrays(prompts, time.perf_counter())[0]


def plan_prefix_token_arrays(prompts: Sequence[Sequence[int]]) -> tuple[PlanArrays, list[np.ndarray]]:
    """plan_prefix_arrays, and each prompt as the 1-D integer array the planner read (a
    scheduler keeps them, so that a step's input ids are array slices, not Python ints)."""
    return _plan_arrays(prompts, time.perf_counter())


def plan_prefix_groups(prompts: Sequence[Sequence[int]]) -> PrefixPlan:
    """Exact maximum of saved = sum_g (|g| - 1) * len(prefix(g)); see docs/design.md.

    prompts: token ids per request (lists, tuples or 1-D integer numpy arrays), each >= 1 token.
    Raises keys.PromptError (a ValueError) for empty prompts or non-integer / negative ids.
    """
    started = time.perf_counter()
    plan, arrays = _plan_arrays(prompts, started)
    to_tuple = _tuple_maker(plan.max_token_id)
    groups = []
    starts = plan.group_start.tolist()
    members = plan.member_request_index.tolist()
    for group_index, prefix_len in enumerate(plan.group_prefix_num_tokens.tolist()):
        indices = members[starts[group_index] : starts[group_index + 1]]
        prefix = to_tuple(arrays[indices[0]][:prefix_len])
        distinct = tuple(to_tuple(arrays[i][prefix_len:]) for i in indices)
        groups.append(PrefixGroup(prefix, tuple(indices), distinct))
    stats = replace(plan.stats, planning_seconds=time.perf_counter() - started)
    return PrefixPlan(tuple(groups), stats)


def _tuple_maker(max_token_id: int):
    """array -> tuple of Python ints; shares int objects for small vocabularies."""
    if max_token_id >= _INTERN_MAX_TOKEN_ID:
        return lambda array: tuple(array.tolist())
    table = list(range(max_token_id + 1))

    def to_tuple(array: np.ndarray) -> tuple[int, ...]:
        if array.size == 0:
            return ()
        if array.size == 1:
            return (table[int(array[0])],)
        return itemgetter(*array.tolist())(table)

    return to_tuple
