"""Data-parallel plan: global prefix groups first, then whole groups to replicas (torch-free).

The steps and the group cost are in docs/scale-out.md. Longest-processing-time first keeps the
makespan within 4/3 of the optimum (Graham; ~1.0 with many small groups). A group alone costing
more than a replica's fair share is cut into the fewest pieces of consecutive members that fit,
each recomputing the prefix once: the sharing lost is reported as sharing_kept.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from batchllm.prefix.planner import PlanArrays, plan_prefix_arrays


@dataclass(frozen=True)
class ReplicaPlan:
    replica_of_request: np.ndarray  # [num_requests] int64
    replica_cost_tokens: np.ndarray  # [num_replicas] float64: token cost assigned to each replica
    unit_replica: np.ndarray  # [num_units] int64: replica of each unit (a group, or a piece of one)
    unit_of_member: np.ndarray  # [num_requests] int64, aligned with plan.member_request_index
    saved_tokens_global: int  # prefill tokens the global plan saves
    saved_tokens_kept: int  # prefill tokens still saved after assignment (pieces recompute prefixes)
    plan: PlanArrays  # the global plan the groups come from

    @property
    def balance(self) -> float:
        """max / mean replica token cost (1.0 = perfect)."""
        mean = float(self.replica_cost_tokens.mean())
        return float(self.replica_cost_tokens.max()) / mean if mean else 1.0

    @property
    def sharing_kept(self) -> float:
        """saved prefill tokens kept / saved by the global plan (1.0 = nothing lost)."""
        return self.saved_tokens_kept / self.saved_tokens_global if self.saved_tokens_global else 1.0

    def requests_of(self, replica: int) -> np.ndarray:
        """Request indices of one replica, grouped (members of a group adjacent)."""
        members = self.plan.member_request_index
        return members[self.unit_replica[self.unit_of_member] == replica]


def assign_lpt(costs: np.ndarray, num_replicas: int) -> tuple[np.ndarray, np.ndarray]:
    """Longest processing time first: (replica per item, load per replica)."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    order = np.argsort(-costs, kind="stable")
    assignment = np.empty(costs.size, dtype=np.int64)
    heap = [(0.0, replica) for replica in range(num_replicas)]
    for item, cost in zip(order.tolist(), costs[order].tolist()):
        load, replica = heapq.heappop(heap)
        assignment[item] = replica
        heapq.heappush(heap, (load + cost, replica))
    loads = np.bincount(assignment, weights=costs, minlength=num_replicas).astype(np.float64)
    return assignment, loads


def plan_replicas(prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], num_replicas: int,
                  decode_token_weight: float = 1.0, split_oversized_groups: bool = True,
                  plan: PlanArrays | None = None) -> ReplicaPlan:
    """Global plan (or the one given), then whole groups to replicas by balanced token cost."""
    plan = plan if plan is not None else plan_prefix_arrays(prompts)
    prompt_num_tokens = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=len(prompts))
    sizes = plan.group_sizes
    prefix = plan.group_prefix_num_tokens
    members = plan.member_request_index
    group_of_member = np.repeat(np.arange(sizes.size), sizes)
    # Each member's own cost: distinct prompt tokens + weighted decode tokens.
    member_cost = (prompt_num_tokens[members] - prefix[group_of_member]
                   + decode_token_weight * np.asarray(max_tokens, dtype=np.int64)[members]).astype(np.float64)
    group_member_cost = np.bincount(group_of_member, weights=member_cost, minlength=sizes.size)
    group_cost = prefix + group_member_cost
    # Pieces per group: 1 unless the group alone exceeds a replica's fair share.
    pieces = np.ones(sizes.size, dtype=np.int64)
    if split_oversized_groups and num_replicas > 1 and sizes.size:
        fair_share = group_cost.sum() / num_replicas
        pieces = np.minimum(sizes, np.maximum(1, np.ceil(group_cost / fair_share).astype(np.int64)))
    # Piece of each member: by its group's running member cost (consecutive members).
    group_start = plan.group_start[:-1]
    running = np.cumsum(member_cost) - member_cost  # cost before this member, batch-wide
    within = running - np.repeat(running[group_start] if members.size else running, sizes)
    piece_size = np.repeat(group_member_cost / pieces, sizes)
    member_pieces = np.repeat(pieces, sizes)
    piece = np.minimum(member_pieces - 1, (within / np.maximum(piece_size, 1e-9)).astype(np.int64))
    unit_base = np.concatenate(([0], np.cumsum(pieces)))[:-1]
    unit_of_member = unit_base[group_of_member] + piece
    num_units = int(pieces.sum())
    unit_size = np.bincount(unit_of_member, minlength=num_units)
    unit_group = np.repeat(np.arange(sizes.size), pieces)
    unit_prefix = prefix[unit_group] * (unit_size > 0)  # an empty piece (never happens) costs nothing
    unit_cost = unit_prefix + np.bincount(unit_of_member, weights=member_cost, minlength=num_units)
    unit_replica, loads = assign_lpt(unit_cost, num_replicas)
    replica_of_request = np.empty(len(prompts), dtype=np.int64)
    replica_of_request[members] = unit_replica[unit_of_member]
    saved_global = int(((sizes - 1) * prefix).sum())
    saved_kept = int((np.maximum(unit_size - 1, 0) * prefix[unit_group]).sum())
    return ReplicaPlan(replica_of_request, loads, unit_replica, unit_of_member, saved_global, saved_kept, plan)
