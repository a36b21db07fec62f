"""Compact prefix tree and sorted keys: structure pinned on small cases, LCPs vs brute force."""

import numpy as np
from hypothesis import given, settings, strategies as st

from fuzz import examples

from batchllm.prefix import plan_prefix_groups
from batchllm.prefix.keys import sort_keys
from batchllm.prefix.tree import build_tree


def _tree_of(prompts):
    keys, _ = sort_keys(prompts)
    return keys, build_tree(keys)


def test_fig4_tree_structure():
    prompts = [[0, 5, 6], [1, 2, 3], [1, 4, 5], [1] + [20] * 7 + [3, 3], [1] + [20] * 7 + [4, 4], [1, 7, 7]]
    keys, tree = _tree_of(prompts)
    depth, parent = tree.depth_num_tokens, tree.parent
    # root; 'b' = [1] at depth 1 with 4 children; the 8-token node with 2 children; leaves
    root_children = sorted(depth[np.flatnonzero(parent == 0)].tolist())
    assert root_children == [1, 2]  # [1] (shared by 5) and [0, 5] (prompt 1's key)
    b = int(np.flatnonzero((parent == 0) & (depth == 1))[0])
    assert sorted(depth[np.flatnonzero(parent == b)].tolist()) == [2, 2, 2, 8]
    assert tree.subtree_num_keys()[b] == 5
    assert tree.num_nodes == 1 + 2 + 4 + 2  # root, 2 first-level, 4 under b, 2 under the 8-node
    assert tree.level.max() == 3


def test_identical_and_nested_keys_end_at_internal_nodes():
    prompts = [[1, 2, 9], [1, 2, 8], [1, 2, 3, 4], [1, 2, 3, 5], [4]]
    keys, tree = _tree_of(prompts)
    # keys: [1,2] x2 (end at depth 2, which also has child [1,2,3]), [1,2,3] x2, [] (root)
    assert tree.num_key_ends[0] == 1  # the single-token prompt's empty key ends at the root
    node_of = tree.request_node
    assert node_of[0] == node_of[1] and tree.depth_num_tokens[node_of[0]] == 2
    assert node_of[2] == node_of[3] and tree.depth_num_tokens[node_of[2]] == 3
    assert tree.num_key_ends[node_of[0]] == 2 and tree.num_key_ends[node_of[2]] == 2
    assert tree.parent[node_of[2]] == node_of[0]


def _assert_lcps_by_counting(prompts, keys):
    """Each neighbour LCP equals a token-by-token count over the two keys."""
    for i in range(1, len(prompts)):
        a, b = prompts[keys.order[i - 1]][:-1], prompts[keys.order[i]][:-1]
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        assert keys.lcp_num_tokens[i] == n


def test_sorted_keys_and_lcp_match_python():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 3, rng.integers(1, 30)).tolist() for _ in range(3000)]
    keys, _ = sort_keys(prompts)
    python_sorted = sorted(range(len(prompts)), key=lambda i: prompts[i][:-1])
    assert [prompts[i][:-1] for i in keys.order] == [prompts[i][:-1] for i in python_sorted]
    _assert_lcps_by_counting(prompts, keys)


def test_lcp_of_long_keys_with_wide_token_ids():
    """Keys of 2- 4- and 8-byte ids (the largest id picks the width), long shared prefixes, a key
    that is another's prefix, identical keys and an empty key: LCPs equal a token-by-token count."""
    rng = np.random.default_rng(1)
    for high in (300, 70_000, 5_000_000_000):
        shared = rng.integers(0, high, 1500).tolist()
        prompts = [shared[:int(rng.integers(0, 1500))] + rng.integers(0, high, int(rng.integers(1, 40))).tolist()
                   for _ in range(200)]
        prompts += [shared + [1], shared + [2], shared[:700] + [3], [high - 1]]
        keys, _ = sort_keys(prompts)
        _assert_lcps_by_counting(prompts, keys)
        assert keys.lcp_num_tokens[0] == 0 and keys.lcp_num_tokens.max() == 1500


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=10), min_size=1, max_size=30))
def test_tree_invariants(prompts):
    keys, tree = _tree_of(prompts)
    depth, parent = tree.depth_num_tokens, tree.parent
    assert parent[0] == -1 and depth[0] == 0
    assert (depth[1:] > depth[parent[1:]]).all()  # strictly deeper than the parent
    assert tree.subtree_num_keys()[0] == len(prompts)
    # compact: every non-root node has a key ending at it or >= 2 children
    children = np.bincount(parent[1:], minlength=tree.num_nodes)
    assert ((tree.num_key_ends[1:] > 0) | (children[1:] >= 2)).all()
    # distinct prefix tokens of the keys == sum of edge lengths
    prefixes = {tuple(p[: k]) for p in prompts for k in range(1, len(p))}
    assert len(prefixes) == int((depth[1:] - depth[parent[1:]]).sum())
    for request, node in enumerate(tree.request_node):
        assert depth[node] == len(prompts[request]) - 1


def test_deep_chain_of_nested_prompts():
    # 400 prompts nested in each other: a 400-level tree; no recursion limit, exact optimum.
    base = list(range(1, 402))
    prompts = [base[: k + 1] for k in range(1, 401)]  # keys of length 1..400
    plan = plan_prefix_groups(prompts)
    # One group of all (prefix = the shortest key, 1 token) saves 399; pairs (2k-1, 2k) save
    # the shorter key each; the optimum is found by the DP and is >= both.
    pairs = sum(k for k in range(1, 401, 2))
    assert plan.saved_num_tokens >= max(399, pairs)
    assert plan.stats.processed_prefill_tokens_multi_level == 400 + 400


def test_too_deep_tree_fails_clearly():
    import pytest
    from batchllm.prefix.optimal import PrefixTreeTooDeepError, solve_optimal

    _, tree = _tree_of([list(range(1, k + 2)) for k in range(1, 60)])
    with pytest.raises(PrefixTreeTooDeepError, match="too deep"):
        solve_optimal(tree, max_table_entries=100)
