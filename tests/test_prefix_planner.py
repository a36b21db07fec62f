"""The planner returns the exact optimum: brute force over all set partitions agrees."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fuzz import examples

from batchllm.prefix import PromptError, plan_prefix_arrays, plan_prefix_groups


def _lcp(keys: list[tuple[int, ...]]) -> int:
    length = min(len(k) for k in keys)
    for i in range(length):
        if any(k[i] != keys[0][i] for k in keys):
            return i
    return length


@functools.cache
def _partitions(n: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """All set partitions of range(n) (Bell(7) = 877)."""
    if n == 0:
        return ((),)
    result = []
    for partition in _partitions(n - 1):
        for i in range(len(partition)):
            result.append(partition[:i] + (partition[i] + (n - 1,),) + partition[i + 1 :])
        result.append(partition + ((n - 1,),))
    return tuple(result)


def brute_force_saved(prompts: list[list[int]]) -> int:
    keys = [tuple(p[:-1]) for p in prompts]
    best = 0
    for partition in _partitions(len(keys)):
        saved = sum((len(g) - 1) * _lcp([keys[i] for i in g]) for g in partition if len(g) > 1)
        best = max(best, saved)
    return best


def check_plan_is_valid(prompts, plan) -> int:
    """Every request in one group; prefix + distinct == prompt; returns the plan's saved."""
    seen = []
    for group in plan.groups:
        assert list(group.request_indices) == sorted(group.request_indices)
        assert len(group.distinct_token_ids) == len(group.request_indices)
        if len(group.request_indices) == 1:
            assert group.prefix_token_ids == ()
        for index, distinct in zip(group.request_indices, group.distinct_token_ids):
            assert len(distinct) >= 1
            assert group.prefix_token_ids + distinct == tuple(prompts[index])
        seen.extend(group.request_indices)
    assert sorted(seen) == list(range(len(prompts)))
    return plan.saved_num_tokens


prompt_lists = st.lists(
    st.lists(st.integers(0, 2), min_size=1, max_size=6), min_size=0, max_size=7
)


@settings(max_examples=examples(500), deadline=None)
@given(prompt_lists)
def test_matches_brute_force_on_small_random_batches(prompts):
    plan = plan_prefix_groups(prompts)
    saved = check_plan_is_valid(prompts, plan)
    assert saved == brute_force_saved(prompts)
    assert plan.stats.saved_prefill_tokens == saved
    # multi-level sharing >= optimal single-level >= naive first level >= none
    stats = plan.stats
    assert stats.processed_prefill_tokens_multi_level <= stats.processed_prefill_tokens
    assert stats.processed_prefill_tokens <= stats.processed_prefill_tokens_naive_first_level
    assert stats.processed_prefill_tokens_naive_first_level <= stats.logical_prefill_tokens


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=9), min_size=1, max_size=7))
def test_matches_brute_force_with_long_binary_prompts(prompts):
    plan = plan_prefix_groups([np.asarray(p, dtype=np.int32) for p in prompts])
    assert check_plan_is_valid(prompts, plan) == brute_force_saved(prompts)


def test_paper_fig4_example():
    # BatchLLM Fig. 4: the root's right child 'b' (1 token) is shared by prompts 2..6, so the
    # naive first-level grouping saves 4 tokens; prompts 4 and 5 share their first 8 tokens.
    b = 1
    prompts = [
        [0, 5, 6],  # prompt 1: under the root's left child
        [b, 2, 3],
        [b, 4, 5],
        [b, 20, 20, 20, 20, 20, 20, 20, 3, 3],  # prompts 4 and 5 share 8 tokens
        [b, 20, 20, 20, 20, 20, 20, 20, 4, 4],
        [b, 7, 7],
    ]
    plan = plan_prefix_groups(prompts)
    stats = plan.stats
    assert stats.logical_prefill_tokens - stats.processed_prefill_tokens_naive_first_level == 4
    # Optimum: {4, 5} share 8 tokens (saves 8) and {2, 3, 6} still share 'b' (saves 2).
    assert plan.saved_num_tokens == 10 == brute_force_saved(prompts)
    shared = {g.request_indices: g.prefix_token_ids for g in plan.groups if len(g.request_indices) > 1}
    assert shared == {(3, 4): (b,) + (20,) * 7, (1, 2, 5): (b,)}
    assert [g.request_indices for g in plan.groups] == [(0,), (1, 2, 5), (3, 4)]
    # Multi-level: 'b' computed once for 5 prompts (4) + the 7 extra shared tokens once (7).
    assert stats.logical_prefill_tokens - stats.processed_prefill_tokens_multi_level == 11


def test_optimum_beats_root_children_on_deep_pairs():
    prompts = [[1, 2, 3, 4, 10, 99], [1, 2, 3, 4, 11, 99], [1, 5, 6, 7, 12, 99],
               [1, 5, 6, 7, 13, 99], [1, 8, 99], [9, 99]]
    plan = plan_prefix_groups(prompts)
    assert plan.saved_num_tokens == 8
    assert plan.stats.logical_prefill_tokens - plan.stats.processed_prefill_tokens_naive_first_level == 4
    assert [g.request_indices for g in plan.groups] == [(0, 1), (2, 3), (4,), (5,)]


def test_empty_prompt_is_rejected():
    with pytest.raises(PromptError, match="needs >= 1 token"):
        plan_prefix_groups([[1, 2], []])


def test_negative_and_float_token_ids_are_rejected():
    with pytest.raises(PromptError, match=">= 0"):
        plan_prefix_groups([[1, 2], [3, -1]])
    with pytest.raises(PromptError, match="integers"):
        plan_prefix_groups([[1.5, 2.0]])


def test_single_token_prompts_share_nothing():
    plan = plan_prefix_groups([[7], [7], [7]])
    assert [g.request_indices for g in plan.groups] == [(0,), (1,), (2,)]
    assert all(g.distinct_token_ids[0] == (7,) for g in plan.groups)
    assert plan.stats.saving_ratio == 0.0


def test_identical_prompts_form_one_group_keeping_the_last_token():
    prompts = [[5, 6, 7, 8]] * 4
    plan = plan_prefix_groups(prompts)
    assert len(plan.groups) == 1
    group = plan.groups[0]
    assert group.prefix_token_ids == (5, 6, 7)
    assert group.distinct_token_ids == ((8,),) * 4
    assert plan.saved_num_tokens == 9


def test_one_huge_group():
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 50000, 500)
    prompts = [np.concatenate((prefix, [i % 50000, 1])) for i in range(20000)]
    plan = plan_prefix_arrays(prompts)
    assert plan.group_sizes.tolist() == [20000]
    assert plan.stats.saved_prefill_tokens == 19999 * 500  # the 500-token prefix
    assert plan.stats.sharing_degree.max == 20000


def test_no_sharing_at_all():
    prompts = [[i, i + 1, i + 2] for i in range(0, 300, 3)]
    plan = plan_prefix_groups(prompts)
    assert len(plan.groups) == 100
    assert plan.stats.num_shared_groups == 0
    assert plan.stats.processed_prefill_tokens == plan.stats.logical_prefill_tokens == 300
    assert plan.stats.saving_ratio_multi_level == 0.0


def test_large_token_ids_and_prefix_keys():
    # ids beyond 2**16 and 2**32 use wider encodings; a key that is a prefix of another.
    big = 1 << 40
    prompts = [[big, 70000, 1], [big, 70000, 2, 3], [big, 70000, 2, 4], [5]]
    plan = plan_prefix_groups(prompts)
    assert plan.saved_num_tokens == brute_force_saved(prompts) == 4  # all three share 2
    assert [g.request_indices for g in plan.groups] == [(0, 1, 2), (3,)]


def test_arrays_and_groups_agree():
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 3, rng.integers(1, 12)).tolist() for _ in range(300)]
    arrays = plan_prefix_arrays(prompts)
    plan = plan_prefix_groups(prompts)
    assert arrays.group_sizes.tolist() == [len(g.request_indices) for g in plan.groups]
    assert arrays.stats.saved_prefill_tokens == plan.saved_num_tokens
