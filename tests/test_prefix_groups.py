"""PrefixGroup / PrefixPlan contract and JSON Lines export."""

import dataclasses
import io
import json

import numpy as np
import pytest

from batchllm.prefix import PrefixGroup, plan_prefix_groups, write_groups_jsonl


def test_group_dataclass_is_frozen_and_counts():
    group = PrefixGroup((1, 2), (0, 3), ((5,), (6, 7)))
    assert group.saved_num_tokens == 2 and len(group.request_indices) == 2 and len(group.prefix_token_ids) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        group.prefix_token_ids = ()


def test_jsonl_export_round_trip():
    prompts = [np.array([1, 2, 3, 4]), np.array([1, 2, 3, 5]), np.array([9, 9])]
    plan = plan_prefix_groups(prompts)
    stream = io.StringIO()
    assert write_groups_jsonl(plan, ["a", "b", "c"], stream) == 2
    lines = stream.getvalue().splitlines()
    assert json.loads(lines[0]) == {
        "prefix_token_ids": [1, 2, 3],
        "requests": [{"custom_id": "a", "distinct_token_ids": [4]}, {"custom_id": "b", "distinct_token_ids": [5]}],
    }
    assert json.loads(lines[1]) == {
        "prefix_token_ids": [], "requests": [{"custom_id": "c", "distinct_token_ids": [9, 9]}]}
    # token ids are plain Python ints (JSON-serialisable), not numpy scalars
    assert all(type(t) is int for t in plan.groups[0].prefix_token_ids + plan.groups[0].distinct_token_ids[0])


def test_duplicate_custom_ids_are_rejected():
    plan = plan_prefix_groups([[1, 2], [1, 3]])
    with pytest.raises(ValueError, match="unique"):
        write_groups_jsonl(plan, ["x", "x"], io.StringIO())


def test_stats_distributions():
    prompts = [[1, 1, 1, 5], [1, 1, 1, 6], [1, 1, 1, 7], [2, 2, 8], [2, 2, 9], [3, 4]]
    stats = plan_prefix_groups(prompts).stats
    assert (stats.num_groups, stats.num_shared_groups, stats.num_singletons) == (3, 2, 1)
    assert stats.sharing_degree.min == 2 and stats.sharing_degree.max == 3
    assert stats.prefix_num_tokens.mean == 2.5
    assert stats.saved_prefill_tokens == 2 * 3 + 1 * 2
    assert stats.to_dict()["saving_ratio"] == pytest.approx(8 / 20)
