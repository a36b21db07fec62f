"""The FLOP bound of a workload against a given peak (bf16, or FP8 for FP8 rows)."""

import pytest

from batchllm.perf.flop_bound import (H200_BF16_PEAK_FLOPS, H200_FP8_PEAK_FLOPS, flop_bound_seconds, peak_flops_for,
                                       work_flop_parts, work_flops)


class _Arch:
    num_layers, num_heads, head_dim, vocab_size, hidden_size = 2, 4, 8, 100, 32

    @staticmethod
    def num_params(include_embeddings: bool) -> int:
        assert not include_embeddings
        return 1000


def test_flop_bound_against_a_given_peak():
    groups = [(10, [2, 3], [0, 1])]  # a 10-token prefix, two members of 2 and 3 distinct tokens
    output_num_tokens = [4, 1]
    # rows: prefix 10 at 0; member 0: 2 + 3 rows at 10; member 1: 3 + 0 rows at 10
    processed, attended = 10 + 5 + 3, (10 * 11 // 2) + (5 * 10 + 15) + (3 * 10 + 6)
    flops = 2.0 * 1000 * processed + 4.0 * 2 * 4 * 8 * attended + 2.0 * 100 * 32 * 5
    assert work_flops(_Arch, groups, output_num_tokens) == flops
    parts = work_flop_parts(_Arch, groups, output_num_tokens)
    assert (parts.linear, parts.attention, parts.lm_head) == (2.0 * 1000 * 18, 4.0 * 2 * 4 * 8 * 156, 2.0 * 100 * 32 * 5)
    assert parts.attention_share == pytest.approx(4.0 * 2 * 4 * 8 * 156 / flops)
    assert flop_bound_seconds(_Arch, groups, output_num_tokens) == flops / H200_BF16_PEAK_FLOPS
    assert flop_bound_seconds(_Arch, groups, output_num_tokens, peak_flops=1e12) == flops / 1e12
    assert peak_flops_for("fp8") == H200_FP8_PEAK_FLOPS and peak_flops_for(None) == H200_BF16_PEAK_FLOPS
    with pytest.raises(ValueError, match="positive"):
        flop_bound_seconds(_Arch, groups, output_num_tokens, peak_flops=0)


def test_plan_groups_give_each_groups_prefix_distinct_lengths_and_members():
    from batchllm.perf.flop_bound import plan_groups
    from batchllm.prefix.planner import plan_prefix_groups

    plan = plan_prefix_groups([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6, 7], [9, 9], [1, 2, 3, 8]])
    assert plan_groups(plan) == [(3, [2, 3, 1], (0, 1, 3)), (0, [2], (2,))]
