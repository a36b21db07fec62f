"""Host work list of the fused kernel: structure checks (no kernel runs)."""

import numpy as np

from batchllm.ops.tile_config import default_tile_config
from batchllm.ops.work_list import (F_KIND, F_KV_END, F_KV_START, F_PARTIAL_BASE, F_Q_COUNT, F_SIZE_CLASS,
                                    KIND_DISTINCT, KIND_PREFIX, SIZE_BIG, build_prefix_shared_plan)


def _decode_groups(num_groups, members, prefix, distinct):
    n = num_groups * members
    qsl = np.arange(n + 1, dtype=np.int32)
    lens = np.full(n, prefix + distinct, np.int32)
    shared = np.full(n, prefix, np.int32)
    tables = np.zeros((n, (prefix + distinct) // 16 + 2), np.int32)
    groups = np.repeat(np.arange(num_groups), members).astype(np.int32)
    return qsl, lens, shared, tables, groups, np.zeros(n, bool)


def test_decode_group_packs_rows_into_one_prefix_matmul():
    tile = default_tile_config(128, 4, interpret=False)
    plan = build_prefix_shared_plan(*_decode_groups(16, 16, 2048, 256), block_size=16, num_kv_heads=8,
                                    num_heads=32, tile=tile)
    w = plan.work
    prefix = w[w[:, F_KIND] == KIND_PREFIX]
    # 16 decode rows x 4 GQA heads = 64 packed rows: one big MatMul tile per prefix piece
    assert (prefix[:, F_Q_COUNT] == 16).all() and (prefix[:, F_SIZE_CLASS] == SIZE_BIG).all()
    assert (prefix[:, F_KV_END] - prefix[:, F_KV_START]).sum() == 16 * 2048  # prefix read once per group
    distinct = w[w[:, F_KIND] == KIND_DISTINCT]
    assert (distinct[:, F_KV_END] - distinct[:, F_KV_START]).sum() == 256 * 256
    # every decode row has >= 2 parts: all partial, merged once per row
    assert (w[:, F_PARTIAL_BASE] >= 0).all() and plan.merge_tokens.shape[0] == 256
    cost = (w[:, F_KV_END] - w[:, F_KV_START])
    assert cost[0] == cost.max()  # largest first


def test_single_part_rows_write_directly():
    qsl = np.array([0, 1, 2], np.int32)
    plan = build_prefix_shared_plan(qsl, np.array([10, 20], np.int32), np.zeros(2, np.int32),
                                    np.zeros((2, 2), np.int32), None, None, block_size=16, num_kv_heads=1,
                                    num_heads=1, tile=default_tile_config(64, 1, interpret=False))
    assert (plan.work[:, F_PARTIAL_BASE] == -1).all() and plan.num_partial_slots == 0
