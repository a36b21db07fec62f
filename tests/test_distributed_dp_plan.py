"""The data-parallel plan: whole groups, every request once, balanced, sharing kept (torch-free)."""

from __future__ import annotations

import numpy as np

from batchllm.distributed.dp_plan import assign_lpt, plan_replicas
from batchllm.perf.workloads import industrial_workload, micro_workload


def test_lpt_is_greedy_longest_first():
    assignment, loads = assign_lpt(np.array([5.0, 4.0, 3.0, 3.0, 3.0]), 2)
    assert assignment.tolist() == [0, 1, 1, 0, 1] and loads.tolist() == [8.0, 10.0]


def test_micro_groups_stay_whole_and_balanced():
    workload = micro_workload(200, 20, 4, num_requests=64, output_num_tokens=10)
    plan = plan_replicas(workload.prompts, workload.max_tokens, 4)
    assert plan.sharing_kept == 1.0 and plan.saved_tokens_kept == plan.saved_tokens_global == 16 * 3 * 200
    assert plan.balance == 1.0  # 16 equal groups over 4 replicas
    # Each group (same first token = same prefix) lives on exactly one replica.
    first_token = np.array([p[0] for p in workload.prompts])
    for token in np.unique(first_token):
        assert np.unique(plan.replica_of_request[first_token == token]).size == 1
    assigned = np.sort(np.concatenate([plan.requests_of(r) for r in range(4)]))
    assert assigned.tolist() == list(range(64))


def test_industrial_64_replicas_split_only_oversized_groups():
    workload = industrial_workload(num_requests=2000)
    whole = plan_replicas(workload.prompts, workload.max_tokens, 64, split_oversized_groups=False)
    split = plan_replicas(workload.prompts, workload.max_tokens, 64)
    assert whole.sharing_kept == 1.0 and whole.balance > 1.5  # one template group dominates
    assert split.balance < 1.1 and 0.999 < split.sharing_kept < 1.0
    total = sum(len(p) + m for p, m in zip(workload.prompts, workload.max_tokens)) - whole.saved_tokens_global
    assert whole.replica_cost_tokens.sum() == total
