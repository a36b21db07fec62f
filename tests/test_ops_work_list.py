"""Host work list of the fused kernel: structure checks (no kernel runs)."""

import numpy as np
import pytest

from batchllm.attention_plan.tile_config import default_tile_config
from batchllm.attention_plan.work_list import (
    F_KIND,
    F_KV_END,
    F_KV_START,
    F_PARTIAL_BASE,
    F_Q_COUNT,
    F_SEQ,
    F_SIZE_CLASS,
    KIND_DISTINCT,
    KIND_PREFIX,
    SIZE_BIG,
    SIZE_SMALL,
    build_prefix_shared_plan,
    item_cost,
    order_items,
    resolve_order,
)


H200_SMS = 132  # plans shaped for an H200 (split-KV pieces sized to fill its SMs)


def _cost(work, tile):
    return item_cost(work[:, F_KV_END].astype(np.int64) - work[:, F_KV_START], work[:, F_SIZE_CLASS], tile)


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
                                    num_heads=32, tile=tile, num_sms=H200_SMS)
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


def test_a_group_split_by_other_seqs_is_refused():
    """A group's prefix segment spans its rows from first to last, so a seq of another group (or
    none) between them would read this group's prefix: such a step is refused, not planned
    into wrong attention. The same seqs with each group's seqs together plan."""
    qsl, lens, shared, tables, _, is_prefix = _decode_groups(1, 4, 64, 16)
    tile = default_tile_config(64, 3, interpret=True)
    kwargs = dict(block_size=16, num_kv_heads=3, num_heads=9, tile=tile, kv_split_tokens=16)
    for split in ([1, 0, 1, 0], [0, -1, 0, 0]):
        with pytest.raises(ValueError, match="group id 1 has other seqs between|group id 0 has other seqs between"):
            build_prefix_shared_plan(qsl, lens, shared, tables, np.array(split, np.int32), is_prefix, **kwargs)
    plan = build_prefix_shared_plan(qsl, lens, shared, tables, np.array([1, 1, 0, -1], np.int32), is_prefix, **kwargs)
    assert (plan.work[:, F_KIND] == KIND_PREFIX).sum() > 0


def test_single_part_rows_write_directly():
    qsl = np.array([0, 1, 2], np.int32)
    plan = build_prefix_shared_plan(qsl, np.array([10, 20], np.int32), np.zeros(2, np.int32),
                                    np.zeros((2, 2), np.int32), None, None, block_size=16, num_kv_heads=1,
                                    num_heads=1, tile=default_tile_config(64, 1, interpret=False), num_sms=H200_SMS)
    assert (plan.work[:, F_PARTIAL_BASE] == -1).all() and plan.num_partial_slots == 0


def test_order_items_interleaves_classes_by_cumulative_cost():
    # BIG costs 6, 3, 3 (total 12: keys 0, .5, .75); SMALL 4, 2, 1, 1 (total 8: keys 0, .5, .75, .875)
    cost = np.array([1, 3, 6, 2, 4, 3, 1], float)
    size = np.array([SIZE_SMALL, SIZE_BIG, SIZE_BIG, SIZE_SMALL, SIZE_SMALL, SIZE_BIG, SIZE_SMALL])
    assert order_items(cost, size, "cost").tolist() == [2, 4, 1, 5, 3, 0, 6]
    # ties of the key: BIG first; within a class stable by cost
    assert order_items(cost, size, "interleave").tolist() == [2, 4, 1, 3, 5, 0, 6]
    only_small = np.full(7, SIZE_SMALL)
    assert order_items(cost, only_small, "interleave").tolist() == order_items(cost, only_small, "cost").tolist()


def _pinned_plan(order):
    # one group of 16 decode rows (x 4 GQA heads = 64 packed rows: BIG prefix tiles), prefix 512
    # in 2 split pieces of 256 (cost 384 each), 16 distinct SMALL tiles of 128 KV (cost 144 each)
    return build_prefix_shared_plan(*_decode_groups(1, 16, 512, 128), block_size=16, num_kv_heads=8,
                                    num_heads=32, tile=default_tile_config(128, 4, interpret=False),
                                    kv_split_tokens=256, order=order)


def test_interleaved_plan_pins_order_and_keeps_items():
    cost_plan, inter_plan = _pinned_plan("cost"), _pinned_plan("interleave")
    key = lambda w: [(int(r[F_KIND]), int(r[F_SEQ]), int(r[F_KV_START])) for r in w]
    big = [(KIND_PREFIX, 0, 0), (KIND_PREFIX, 0, 256)]
    small = [(KIND_DISTINCT, s, 512) for s in range(16)]
    assert key(cost_plan.work) == big + small  # a compute phase, then a memory phase
    # BIG keys 0, .5; SMALL keys i / 16: B0 S0..S7 B1 S8..S15
    assert key(inter_plan.work) == big[:1] + small[:8] + big[1:] + small[8:]
    assert sorted(map(tuple, cost_plan.work.tolist())) == sorted(map(tuple, inter_plan.work.tolist()))
    assert (inter_plan.work[:, F_SIZE_CLASS] == np.where(inter_plan.work[:, F_KIND] == KIND_PREFIX, SIZE_BIG,
                                                        SIZE_SMALL)).all()
    # each kind's items keep the same cost order under both orders
    for kind in (KIND_PREFIX, KIND_DISTINCT):
        a, b = (plan.work[plan.work[:, F_KIND] == kind] for plan in (cost_plan, inter_plan))
        assert np.array_equal(a, b)
        assert (np.diff(_cost(a, cost_plan.tile)) <= 0).all()


def _ragged_batch():
    """40 seqs in 4 groups sharing 300 tokens, 3 of them 64-row prefill chunks: (args, kwargs)."""
    rng = np.random.default_rng(0)
    n = 40
    lens = (300 + rng.integers(1, 700, n)).astype(np.int32)
    q = np.where(np.arange(n) < 3, 64, 1)
    lens[:3] = 300 + 64
    qsl = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    groups = (np.arange(n) % 4).astype(np.int32)
    order = np.argsort(groups, kind="stable")  # rows laid out group by group
    args = (qsl, lens[order], np.full(n, 300, np.int32), np.zeros((n, 64), np.int32), groups[order],
            np.zeros(n, bool))
    kw = {"block_size": 16, "num_kv_heads": 8, "num_heads": 32,
          "tile": default_tile_config(128, 4, interpret=False), "num_sms": H200_SMS}
    return args, kw


def test_interleaved_plan_same_items_on_a_ragged_batch():
    args, kw = _ragged_batch()
    a = build_prefix_shared_plan(*args, order="cost", **kw)
    b = build_prefix_shared_plan(*args, order="interleave", **kw)
    assert sorted(map(tuple, a.work.tolist())) == sorted(map(tuple, b.work.tolist()))
    assert not np.array_equal(a.work, b.work)
    for cls in (SIZE_BIG, SIZE_SMALL):  # each class keeps its cost order
        wa, wb = a.work[a.work[:, F_SIZE_CLASS] == cls], b.work[b.work[:, F_SIZE_CLASS] == cls]
        assert np.array_equal(wa, wb)
    # a BIG item in the first tenth of the grid and a SMALL one as well
    head = b.work[: max(2, len(b.work) // 10), F_SIZE_CLASS]
    assert {SIZE_BIG, SIZE_SMALL} <= set(head.tolist())
    assert (np.diff(_cost(a.work, a.tile)) <= 0).all()  # the cost order: largest first


def test_auto_order_interleaves_only_steps_with_prefill_chunks():
    # decode only (BIG tiles are prefix tiles): auto = cost order
    decode = _pinned_plan("auto")
    assert np.array_equal(decode.work, _pinned_plan("cost").work)
    # the ragged batch has 64-row prefill chunks (BIG distinct tiles): auto = interleave
    args, kw = _ragged_batch()
    chunked = build_prefix_shared_plan(*args, order="auto", **kw)
    assert ((chunked.work[:, F_SIZE_CLASS] == SIZE_BIG) & (chunked.work[:, F_KIND] == KIND_DISTINCT)).any()
    assert np.array_equal(chunked.work, build_prefix_shared_plan(*args, order="interleave", **kw).work)
    assert np.array_equal(build_prefix_shared_plan(*args, **kw).work, chunked.work)  # the default
    assert resolve_order("cost", np.array([SIZE_BIG]), np.array([KIND_DISTINCT])) == "cost"
    assert resolve_order("auto", np.array([SIZE_BIG, SIZE_SMALL]), np.array([KIND_PREFIX, KIND_DISTINCT])) == "cost"


def test_device_plan_views_start_16_byte_aligned():
    """Regression: the plan's device views lay at offsets that depended on the step's sizes, and
    Triton specialises pointer arguments on 16-byte alignment, so steps compiled new kernel
    variants in the middle of timed runs (the vllm row of one H200 bench: 20 s -> 28 s). Every
    view now starts on a 16-byte boundary of the one buffer, whatever the sizes."""
    from dataclasses import fields, replace

    import torch

    from batchllm.ops.plan_device import PrefixSharedPlanOnDevice, plan_to_device

    for num_groups, members, prefix, distinct in [(3, 5, 37, 9), (1, 7, 16, 1), (2, 3, 33, 17)]:
        args = list(_decode_groups(num_groups, members, prefix, distinct))
        args[3] = np.zeros((args[3].shape[0], args[3].shape[1] + 1), np.int32)  # odd table width
        plan = build_prefix_shared_plan(*args, block_size=16, num_kv_heads=1, num_heads=3,
                                        tile=replace(default_tile_config(64, 3, interpret=False), split_classes=True),
                                        num_sms=H200_SMS)
        device_plan = plan_to_device(plan, "cpu")
        base = device_plan.work.data_ptr()
        views = [getattr(device_plan, f.name) for f in fields(PrefixSharedPlanOnDevice)]
        views = [v for v in views if isinstance(v, torch.Tensor)]
        assert len(views) == 8  # six plan arrays and the BIG / SMALL lists of the class-split launches
        assert all((v.data_ptr() - base) % 16 == 0 for v in views)
        np.testing.assert_array_equal(device_plan.block_tables.numpy(), plan.block_tables)
        np.testing.assert_array_equal(device_plan.merge_slots.numpy(), plan.merge_slots)


def test_split_kv_pieces_fill_the_given_sm_count():
    """Split-KV pieces are sized so that num_sms x 4 programs run (8 KV heads, KV steps of 16): 16
    decode rows of one group, 8 rows per BIG tile (2 prefix tiles of 512 KV positions) and 16
    distinct tiles of 128, 3072 positions in all. More SMs, smaller pieces."""
    args = _decode_groups(1, 16, 512, 128)
    tile = default_tile_config(128, 4, interpret=True)  # min piece 16, KV step 16

    def kv_lens(num_sms):
        plan = build_prefix_shared_plan(*args, block_size=16, num_kv_heads=8, num_heads=32, tile=tile,
                                        num_sms=num_sms, order="cost")
        return sorted((plan.work[:, F_KV_END] - plan.work[:, F_KV_START]).tolist(), reverse=True)

    # 8 SMs: 4 items wanted, pieces of ceil(3072 / 4) = 768: nothing is split
    assert kv_lens(8) == [512] * 2 + [128] * 16
    # 132 SMs: 66 items wanted, pieces of ceil(3072 / 66) = 47 -> 48: a prefix tile in 10 x 48 + 32,
    # a distinct one in 48 + 48 + 32
    assert kv_lens(132) == [48] * (2 * 10 + 16 * 2) + [32] * (2 + 16)
    with pytest.raises(ValueError, match="num_sms"):
        build_prefix_shared_plan(*args, block_size=16, num_kv_heads=8, num_heads=32, tile=tile)


def test_graph_layout_cuts_the_buffer_like_a_step_plan():
    """The decode CUDA graphs' static buffer and a step plan's buffer share one layout class: the
    same arrays in the same order, every view 16-byte aligned, shapes as declared."""
    from batchllm.attention_plan.layout import PLAN_ARRAYS, graph_layout, step_layout

    layout = graph_layout(num_rows=16, num_blocks=32, items_capacity=1088, slots_capacity=1152, work_fields=12)
    views = layout.views(np.zeros(layout.num_int32, np.int32))
    assert list(views)[:len(PLAN_ARRAYS)] == list(PLAN_ARRAYS)
    assert list(views)[len(PLAN_ARRAYS):] == ["num_items", "work_small", "seq_lens"]
    assert views["work"].shape == (1088, 12) and views["block_tables"].shape == (16, 32)
    assert views["seq_lens"].shape == (16,)
    assert views["merge_offsets"].shape == (17,) and views["num_items"].shape == (3,)
    assert all(start % 4 == 0 for start in layout.starts)
    arrays = {"work": np.arange(36, dtype=np.int32).reshape(3, 12), "prefix_limit": np.arange(5, dtype=np.int32)}
    step = step_layout(arrays)
    assert step.starts == [0, 36, 44]  # 5 entries padded to 8
    unpacked = step.views(step.pack(arrays))
    assert all(np.array_equal(unpacked[name], arrays[name]) for name in arrays)


def _group_and_chunks_batch():
    """Group 0: a 5-row prefix chunk at positions 35-39 and two members' chunks of 6 and 4 rows
    after its 40 positions; an ungrouped 7-row chunk at positions 53-59; a decode row of group 1."""
    from synthetic_batch import SeqSpec, make_batch

    seqs = [SeqSpec(5, 40, 0, 0, True), SeqSpec(6, 46, 40, 0), SeqSpec(4, 44, 40, 0), SeqSpec(7, 60),
            SeqSpec(1, 30, 21, 1)]
    return make_batch(seqs, num_heads=8, num_kv_heads=2, head_dim=16, block_size=16)


def test_dense_calls_take_the_kv_every_row_of_a_segment_sees():
    """Group 0's members (chunks of 6 and 4 rows) see its whole 40-position prefix, and an
    ungrouped 7-row chunk at positions 53-59 sees its first 53 positions whole. From 6 rows: the
    members' 10 rows reach the threshold, so the group's 5-row prefix chunk leaves their segment
    and they get one call over all 40 positions (a size of the dense calls), the 7-row chunk a call
    for its first 48 positions (the rest of its context stays in tiles) and a causal call for its
    own positions. The 5-row prefix chunk is below the threshold: one causal tile over its
    positions. A one-row decode is below the row threshold."""
    from dataclasses import replace

    from batchllm.attention_plan.work_list import F_MASK_MODE, F_Q_START, MASK_CAUSAL, build_prefix_shared_plan

    b = _group_and_chunks_batch()
    tile = replace(default_tile_config(64, 4, interpret=True), dense_min_rows=6, dense_min_tokens=8)
    plan = build_prefix_shared_plan(**b.metadata_numpy(), block_size=16, num_kv_heads=2, num_heads=8, tile=tile,
                                    kv_split_tokens=1024)
    # q_start, rows, seq, first block, offset, KV positions, [first partial slot], causal, batch:
    # the unmasked calls, then the causal ones; a member's own KV starts at block 3 of its table
    # (after the shared 40 positions)
    assert plan.dense[:, [0, 1, 2, 3, 4, 5, 7, 8]].tolist() == [
        [5, 10, 0, 0, 0, 40, 0, 1], [15, 7, 3, 0, 0, 48, 0, 1], [5, 6, 1, 3, 0, 6, 1, 1], [15, 7, 3, 3, 5, 7, 1, 1]]
    assert (plan.dense[:, 6] >= 0).all()  # every row of a call has other parts too: partial slots
    prefix = plan.work[(plan.work[:, F_KIND] == KIND_PREFIX) & (plan.work[:, F_SEQ] == 0)]  # group 0's
    assert prefix[:, [F_Q_START, F_Q_COUNT, F_KV_START, F_KV_END, F_MASK_MODE]].tolist() == [[0, 5, 0, 40, MASK_CAUSAL]]
    chunk = plan.work[plan.work[:, F_SEQ] == 3]  # the 7-row chunk's context past the call: 48-53
    assert chunk[:, F_KV_START].min() == 48 and chunk[:, F_KV_END].max() == 53
    # every row's parts are merged: a slot per dense row, and the calls' slots are distinct
    slots = np.concatenate([np.arange(base, base + rows) for rows, base in plan.dense[:, [1, 6]]])
    assert np.unique(slots).size == 30 and np.isin(slots, plan.merge_slots).all()
    off = build_prefix_shared_plan(**b.metadata_numpy(), block_size=16, num_kv_heads=2, num_heads=8,
                                   tile=replace(tile, dense_min_rows=0), kv_split_tokens=1024)
    assert off.dense.shape == (0, 9)
    calls = lambda **change: build_prefix_shared_plan(
        **b.metadata_numpy(), block_size=16, num_kv_heads=2, num_heads=8, tile=replace(tile, **change),
        kv_split_tokens=1024).dense[:, [0, 1, 5, 7]].tolist()
    # unmasked calls from 40 positions: the members' call stays; from 41 the 40-position prefix is
    # too short, and the 53-position context still gets a 48-position call
    assert calls(dense_min_tokens=40)[0] == [5, 10, 40, 0]
    assert calls(dense_min_tokens=41) == [[15, 7, 48, 0], [5, 6, 6, 1], [15, 7, 7, 1]]
    # causal squares from 7 rows: the member's 6 rows stay in tiles
    assert calls(dense_causal_min_rows=7) == [[5, 10, 40, 0], [15, 7, 48, 0], [15, 7, 7, 1]]
    # from 8 rows: none; the 7-row chunk's call takes the positions its first row sees (54), cut to 48
    assert calls(dense_causal_min_rows=8) == [[5, 10, 40, 0], [15, 7, 48, 0]]


def test_a_prefix_chunk_with_few_members_keeps_its_group_segment():
    """From 11 rows the members' 10 rows are too few for a call of their own: the group's 5-row
    prefix chunk stays in their segment, whose 15 rows all see the prefix up to the chunk's first
    row limit (36), cut down to the dense calls' sizes: one call over 32 positions. The rest of the
    prefix stays in tiles, row-limited where the chunk's rows see less; the 7-row chunk is below
    the threshold."""
    from dataclasses import replace

    from batchllm.attention_plan.work_list import F_MASK_MODE, MASK_ROW_LIMIT, build_prefix_shared_plan

    b = _group_and_chunks_batch()
    tile = replace(default_tile_config(64, 4, interpret=True), dense_min_rows=11, dense_min_tokens=8)
    plan = build_prefix_shared_plan(**b.metadata_numpy(), block_size=16, num_kv_heads=2, num_heads=8, tile=tile,
                                    kv_split_tokens=1024)
    assert plan.dense[:, [0, 1, 2, 3, 4, 5, 7, 8]].tolist() == [[0, 15, 0, 0, 0, 32, 0, 1]]
    prefix = plan.work[(plan.work[:, F_KIND] == KIND_PREFIX) & (plan.work[:, F_SEQ] == 0)]
    assert prefix[:, F_KV_START].min() == 32 and prefix[:, F_KV_END].max() == 40
    assert (prefix[:, F_MASK_MODE] == MASK_ROW_LIMIT).any()  # the prefix chunk's rows see 36-40


def test_long_prefix_chunks_leave_their_group_segment():
    """From 4 rows the group's 5-row prefix chunk is carved out of its group's segment: a call
    for its first 35 positions cut down to the dense calls' sizes (32; positions 32-34 stay in a
    tile) and a causal call for its own 35-39 (through its own block table), while the members'
    rows see the whole 40-position prefix in one call. The ungrouped chunk's context call takes 48
    of its 53 positions; the prefix chunk's rows have no row-limit tile."""
    from dataclasses import replace

    from batchllm.attention_plan.work_list import build_prefix_shared_plan

    b = _group_and_chunks_batch()
    tile = replace(default_tile_config(64, 4, interpret=True), dense_min_rows=4, dense_min_tokens=8)
    plan = build_prefix_shared_plan(**b.metadata_numpy(), block_size=16, num_kv_heads=2, num_heads=8, tile=tile,
                                    kv_split_tokens=1024)
    assert plan.dense[:, [0, 1, 2, 3, 4, 5, 7]].tolist() == [
        [0, 5, 0, 0, 0, 32, 0], [5, 10, 0, 0, 0, 40, 0], [15, 7, 3, 0, 0, 48, 0],
        [0, 5, 0, 2, 3, 5, 1], [5, 6, 1, 3, 0, 6, 1], [11, 4, 2, 3, 0, 4, 1], [15, 7, 3, 3, 5, 7, 1]]
    # the decode row's prefix piece and own KV, and what the two calls cut down leave
    assert sorted(plan.work[:, [F_SEQ, F_KV_START, F_KV_END]].tolist()) == [
        [0, 32, 35], [3, 48, 53], [4, 0, 21], [4, 21, 30]]


def test_equal_causal_squares_on_consecutive_rows_run_as_one_batched_call():
    """Three fresh 6-token prompts on consecutive rows are causal squares of one length and block
    offset: with causal calls from 12 rows in all they run as one call of batch 3 (its blocks
    three runs of one block each). A 5-token prompt after them differs in length, and a 6-row
    chunk at positions 4-9 in block offset: alone they are below 12 rows and stay in tiles. With
    calls from 19 rows, the batch of 18 rows is too small as well."""
    from dataclasses import replace

    from batchllm.attention_plan.work_list import build_prefix_shared_plan
    from batchllm.ops.plan_device import plan_to_device
    from synthetic_batch import SeqSpec, make_batch

    seqs = [SeqSpec(6, 6), SeqSpec(6, 6), SeqSpec(6, 6), SeqSpec(5, 5), SeqSpec(6, 10)]
    b = make_batch(seqs, num_heads=8, num_kv_heads=2, head_dim=16, block_size=16)
    tile = replace(default_tile_config(64, 4, interpret=True), dense_min_rows=4, dense_min_tokens=8,
                   dense_causal_min_rows=12)
    plan = build_prefix_shared_plan(**b.metadata_numpy(), block_size=16, num_kv_heads=2, num_heads=8, tile=tile,
                                    kv_split_tokens=1024)
    # q_start, rows, seq, first block, offset, KV positions, first partial slot, causal, batch
    assert plan.dense.tolist() == [[0, 6, 0, 0, 0, 6, -1, 1, 3], [6, 6, 1, 0, 0, 6, -1, 1, 0],
                                   [12, 6, 2, 0, 0, 6, -1, 1, 0]]
    assert sorted(set(plan.work[:, F_SEQ].tolist())) == [3, 4]
    calls = plan_to_device(plan, "cpu").dense
    assert [(c.q_start, c.q_count, c.batch, c.kv_len, c.causal) for c in calls] == [(0, 18, 3, 6, True)]
    assert calls[0].blocks.tolist() == [int(b.block_tables[s, 0]) for s in range(3)]
    fewer = build_prefix_shared_plan(**b.metadata_numpy(), block_size=16, num_kv_heads=2, num_heads=8,
                                     tile=replace(tile, dense_causal_min_rows=19), kv_split_tokens=1024)
    assert fewer.dense.shape == (0, 9)


def test_dense_call_sizes_step_by_an_eighth_of_their_octave():
    """The dense calls' sizes: steps of 2^(bit_length - 3), so 512-1024 by 128 and 1024-2048 by
    256; rows pad up to them."""
    from batchllm.attention_plan.dense_calls import dense_rows_padded, dense_size_step

    sizes = np.array([1, 7, 8, 15, 512, 513, 828, 1221, 2000, 2361, 4097])
    assert dense_size_step(sizes).tolist() == [1, 1, 2, 2, 128, 128, 128, 256, 256, 512, 1024]
    assert [dense_rows_padded(int(n)) for n in sizes] == [1, 7, 8, 16, 512, 640, 896, 1280, 2048, 2560, 5120]


def test_dense_calls_of_varied_chunks_meet_few_shapes():
    """200 chunks of 512-2047 rows after contexts of 1024-4095 positions, each a different shape:
    their unmasked calls' KV is cut down to the sizes (by less than a quarter; the rest stays in
    tiles) and their rows pad up to them, so the library kernel sees 4 sizes an octave each way,
    at most 9 x 8 shapes here."""
    from dataclasses import replace

    from batchllm.attention_plan.dense_calls import dense_rows_padded, dense_size_step
    from batchllm.attention_plan.work_list import F_KV_START, build_prefix_shared_plan
    from synthetic_batch import SeqSpec, make_batch

    rng = np.random.default_rng(7)
    rows, contexts = rng.integers(512, 2048, 200), rng.integers(1024, 4096, 200)
    shapes, exact = set(), set()
    tile = replace(default_tile_config(128, 4, interpret=False), dense_causal_min_rows=1 << 30)  # no squares
    for num_rows, context in zip(rows.tolist(), contexts.tolist()):
        b = make_batch([SeqSpec(num_rows, context + num_rows), SeqSpec(1, 300)], num_heads=8, num_kv_heads=2,
                       head_dim=16, block_size=16)
        plan = build_prefix_shared_plan(**b.metadata_numpy(), block_size=16, num_kv_heads=2, num_heads=8,
                                        head_dim=128, tile=tile, kv_split_tokens=1 << 20)
        (call,) = plan.dense.tolist()
        kv_len = call[5]
        assert kv_len % int(dense_size_step(np.array([kv_len]))[0]) == 0 and context - kv_len < context / 4
        chunk = plan.work[plan.work[:, F_SEQ] == 0]
        assert chunk[:, F_KV_START].min() == kv_len  # the context past the call stays in tiles
        shapes.add((dense_rows_padded(num_rows), kv_len))
        exact.add((num_rows, context))
    row_sizes = {512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048}
    kv_sizes = {1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584}
    assert {r for r, _ in shapes} <= row_sizes and {kv for _, kv in shapes} <= kv_sizes
    assert len(exact) == 200 and len(shapes) <= len(row_sizes) * len(kv_sizes)


def test_dense_calls_of_any_size_keep_their_whole_context():
    """With dense_any_size (a kernel that takes any lengths) the 7-row chunk's unmasked call takes
    all 53 positions before its first row rather than the 48 of the sizes' grid, and no tile reads
    its context; the other calls stay as they are."""
    from dataclasses import replace

    from batchllm.attention_plan.work_list import build_prefix_shared_plan

    b = _group_and_chunks_batch()
    tile = replace(default_tile_config(64, 4, interpret=True), dense_min_rows=6, dense_min_tokens=8,
                   dense_any_size=True)
    plan = build_prefix_shared_plan(**b.metadata_numpy(), block_size=16, num_kv_heads=2, num_heads=8, tile=tile,
                                    kv_split_tokens=1024)
    assert plan.dense[:, [0, 1, 2, 3, 4, 5, 7, 8]].tolist() == [
        [5, 10, 0, 0, 0, 40, 0, 1], [15, 7, 3, 0, 0, 53, 0, 1], [5, 6, 1, 3, 0, 6, 1, 1], [15, 7, 3, 3, 5, 7, 1, 1]]
    chunk = plan.work[plan.work[:, F_SEQ] == 3]
    assert chunk.shape[0] == 0  # its context is the call's, its own positions the square's


def test_a_whole_causal_call_holds_its_chunks_context():
    """With dense_causal_whole the 7-row chunk at positions 53-59 gets one causal call over all 60
    of its positions (a bottom-right mask) and no unmasked call: its rows have no other part, so
    they write to the output (no partial slot). The members' call over the shared prefix and the
    member's own 6-row square stay as they are."""
    from dataclasses import replace

    from batchllm.attention_plan.work_list import build_prefix_shared_plan

    b = _group_and_chunks_batch()
    tile = replace(default_tile_config(64, 4, interpret=True), dense_min_rows=6, dense_min_tokens=8,
                   dense_any_size=True, dense_causal_whole=True)
    plan = build_prefix_shared_plan(**b.metadata_numpy(), block_size=16, num_kv_heads=2, num_heads=8, tile=tile,
                                    kv_split_tokens=1024)
    print(plan.dense.tolist())
    assert plan.dense[:, [0, 1, 2, 3, 4, 5, 7, 8]].tolist() == [
        [5, 10, 0, 0, 0, 40, 0, 1], [5, 6, 1, 3, 0, 6, 1, 1], [15, 7, 3, 0, 0, 60, 1, 1]]
    assert plan.dense[2, 6] == -1 and (plan.dense[:2, 6] >= 0).all()
    assert (plan.work[:, F_SEQ] != 3).all()  # no tile reads the chunk's KV
