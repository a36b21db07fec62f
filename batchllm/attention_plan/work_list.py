"""Host side of the fused prefix-shared attention: the int32 work list (BatchLLM section 5).

Built once per step with vectorised numpy from CPU copies of the step metadata (the same for
all layers). The tiles, split-KV pieces, merges, work orders and the cost model of `item_cost`:
docs/design.md ("Prefix-shared attention").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from batchllm.attention_plan.checks import check
from batchllm.attention_plan.dense_calls import (DENSE_FIELDS, batch_squares, carve_prefix_chunks, carved_seqs,
                                                 cut_dense_calls, square_seqs)
from batchllm.attention_plan.segments import (  # noqa: F401 (the F_MASK_MODE and F_KIND values, named here too)
    KIND_DISTINCT, KIND_PREFIX, MASK_CAUSAL, MASK_NONE, MASK_ROW_LIMIT, Columns, Segments, ceil_div, flat_ranges,
    index_within, row_prefix_limits, step_arrays, step_groups, step_segments)
from batchllm.attention_plan.tile_config import TileConfig, default_tile_config

# Work-item fields (columns of the int32 work list).
F_Q_START, F_Q_COUNT, F_SEQ, F_KV_START, F_KV_END, F_BASE_BLOCK, F_BASE_POS = range(7)
F_MASK_MODE, F_Q_POS0, F_PARTIAL_BASE, F_SIZE_CLASS, F_KIND = range(7, 12)
WORK_FIELDS = 12
SIZE_SMALL, SIZE_BIG = 0, 1
WORK_ORDERS = ("cost", "interleave", "auto")
# Order used when build_prefix_shared_plan gets no `order` (the engine's).
DEFAULT_WORK_ORDER = "auto"


def item_cost(kv_len, size_class, tile: TileConfig) -> np.ndarray:
    """Estimated cost of work items (docs/design.md): kv_len * (1 + m_pad / 128)."""
    m_pad = np.where(np.asarray(size_class) == SIZE_SMALL, tile.small_m, tile.big_m)
    return np.asarray(kv_len, np.int64) * (1.0 + m_pad / 128.0)


def resolve_order(order: str, size_class: np.ndarray, kind: np.ndarray) -> str:
    """"auto" -> "interleave" if any BIG distinct tile (a prefill chunk) is in the step, else "cost"."""
    check(order in WORK_ORDERS, f"order must be one of {WORK_ORDERS}, got {order!r}")
    if order != "auto":
        return order
    has_chunk = bool(np.any((np.asarray(size_class) == SIZE_BIG) & (np.asarray(kind) == KIND_DISTINCT)))
    return "interleave" if has_chunk else "cost"


def order_items(cost: np.ndarray, size_class: np.ndarray, order: str) -> np.ndarray:
    """Permutation of work items for `order` ("cost" or "interleave", docs/design.md)."""
    check(order in ("cost", "interleave"), f"order must be 'cost' or 'interleave' here, got {order!r}")
    by_cost = np.argsort(-cost, kind="stable")
    if order == "cost":
        return by_cost
    parts, keys = [], []
    for cls in (SIZE_BIG, SIZE_SMALL):  # BIG first: it wins ties of the merge key
        idx = by_cost[size_class[by_cost] == cls]
        c = cost[idx]
        parts.append(idx)
        keys.append((np.cumsum(c) - c) / max(float(c.sum()), 1e-30))
    merged = np.concatenate(parts)
    return merged[np.argsort(np.concatenate(keys), kind="stable")]


@dataclass
class PrefixSharedPlan:
    """Host (numpy) work list of one step; moved to the device once (ops.plan_device.plan_to_device)
    and used by every layer."""

    work: np.ndarray  # [num_items, WORK_FIELDS] int32, in the plan's work order (see `order`)
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32
    prefix_limit: np.ndarray  # [num_tokens] int32: prefix KV positions visible to each row
    merge_tokens: np.ndarray  # [num_merge_tokens] int32: rows whose partials need merging
    merge_offsets: np.ndarray  # [num_merge_tokens + 1] int32 (CSR into merge_slots)
    merge_slots: np.ndarray  # [num_partial_slots] int32
    num_tokens: int
    num_heads: int
    num_kv_heads: int
    block_size: int
    tile: TileConfig
    # [num_dense_calls, DENSE_FIELDS] int64: rows [q_start, q_start + q_count) x the kv_len
    # positions that start `offset` into block-table entry first_block of row `seq`, as one
    # dense attention call whose outputs go to partial slots from partial_base, causal (1) or
    # unmasked (0) (cut_dense_calls); batch: at the first call of a batch of causal calls run as one
    # (batch_squares) the number of calls it holds, 0 for the others, 1 for a call alone
    dense: np.ndarray = field(default_factory=lambda: np.zeros((0, DENSE_FIELDS), np.int64))
    # [num_lead_rows] int32: the KV positions of the step's first rows, one row per seq, which the
    # work list leaves to another kernel (the xqa backend's decode rows, reading [0, len) through
    # their own block tables); empty: none
    lead_seq_lens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))

    @property
    def num_partial_slots(self) -> int:
        return int(self.merge_slots.shape[0])

    def class_lists(self) -> tuple[np.ndarray, np.ndarray]:
        """The work lists of the launches: with tile.split_classes (BIG items, SMALL items), else
        (all items, none); each in work order."""
        if not self.tile.split_classes:
            return self.work, self.work[:0]
        big = self.work[:, F_SIZE_CLASS] == SIZE_BIG
        return self.work[big], self.work[~big]

    def item_counts(self, lists: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """[3] int32, what persistent launches read on the device: the BIG items (all items
        without split classes), the SMALL items (none), and the SMALL items that a packed launch
        runs one to a program (num_unpacked_items). lists: class_lists(), where the caller has it."""
        big, small = self.class_lists() if lists is None else lists
        return np.array([big.shape[0], small.shape[0], num_unpacked_items(small, self.tile)], np.int32)


def num_unpacked_items(small: np.ndarray, tile: TileConfig) -> int:
    """How many of a SMALL work list's first items a packed launch (tile.small_pack > 1) runs one to
    a program: those over tile.small_pack_max_positions KV positions, which come first in the
    list's cost order."""
    if tile.small_pack == 1:
        return 0
    return int(((small[:, F_KV_END] - small[:, F_KV_START]) > tile.small_pack_max_positions).sum())


@dataclass
class _Tiles(Columns):
    """Row tiles of segments (GQA heads of one KV head packed with rows into M), later their
    split-KV pieces: the work items."""

    segment: np.ndarray
    q_start: np.ndarray
    num_rows: np.ndarray
    first_position: np.ndarray
    kv_start: np.ndarray
    kv_end: np.ndarray
    mask_mode: np.ndarray
    size_class: np.ndarray


def _row_tiles(seg: Segments, prefix_limit: np.ndarray, tile: TileConfig, group_size: int) -> _Tiles:
    """Cut segments into row tiles; clip each tile's KV to what its rows see and drop the masks
    that no row needs."""
    small_rows, big_rows = max(1, tile.small_m // group_size), max(1, tile.big_m // group_size)
    if tile.small_pack > 1:  # packed SMALL items are one row each
        small_rows = 1
    rows_per_tile = np.where(seg.num_rows <= small_rows, small_rows, big_rows)
    segment, index = index_within(ceil_div(seg.num_rows, rows_per_tile))
    row_offset = index * rows_per_tile[segment]
    tiles = _Tiles(segment, seg.q_start[segment] + row_offset,
                   np.minimum(rows_per_tile[segment], seg.num_rows[segment] - row_offset),
                   seg.first_position[segment] + row_offset, seg.kv_start[segment], seg.kv_end[segment],
                   seg.mask_mode[segment], np.zeros(segment.shape[0], np.int64))
    # causal: clip KV to the tile's last row; no mask when the first row sees the whole range
    causal = tiles.mask_mode == MASK_CAUSAL
    tiles.kv_end[causal] = np.minimum(tiles.kv_end[causal], tiles.first_position[causal] + tiles.num_rows[causal])
    tiles.mask_mode[causal & (tiles.first_position + 1 >= tiles.kv_end)] = MASK_NONE
    # row limits on prefix tiles: clip to the largest, mask only if some row sees less
    limited = np.nonzero(tiles.mask_mode == MASK_ROW_LIMIT)[0]
    if limited.size:
        rows = flat_ranges(tiles.q_start[limited], tiles.num_rows[limited])
        starts = np.cumsum(tiles.num_rows[limited]) - tiles.num_rows[limited]
        least = np.minimum.reduceat(prefix_limit[rows], starts)
        most = np.maximum.reduceat(prefix_limit[rows], starts)
        tiles.kv_end[limited] = np.minimum(tiles.kv_end[limited], most)
        tiles.mask_mode[limited[least >= tiles.kv_end[limited]]] = MASK_NONE
    tiles = tiles.take(np.nonzero(tiles.kv_end > tiles.kv_start)[0])
    tiles.size_class = np.where(tiles.num_rows <= small_rows, SIZE_SMALL, SIZE_BIG)
    return tiles


def _kv_piece_tokens(tiles: _Tiles, tile: TileConfig, kv_split_tokens: int | None, num_sms: int | None,
                     programs_per_sm: int, num_kv_heads: int) -> int:
    """Split-KV piece length: fixed, or enough items to fill the GPU (num_sms x programs_per_sm
    programs), never below tile.min_kv_split_tokens; a multiple of the KV step."""
    if kv_split_tokens is None:
        check(num_sms is not None, "num_sms (the device's SM count, see ops.plan_device.device_num_sms) or "
              "kv_split_tokens is needed")
        kv_len = tiles.kv_end - tiles.kv_start
        target_items = max(1, num_sms * programs_per_sm // num_kv_heads)
        piece = max(tile.min_kv_split_tokens, int(ceil_div(int(kv_len.sum()), target_items)) if kv_len.size else 1)
    else:
        piece = kv_split_tokens
    return int(ceil_div(piece, tile.kv_split_multiple) * tile.kv_split_multiple)


def _split_kv(tiles: _Tiles, piece_tokens: int, multiple: int) -> _Tiles:
    """Each tile's KV range in equal pieces (multiples of the KV step) of at most piece_tokens;
    pieces past a causal tile's last row vanish."""
    kv_len = tiles.kv_end - tiles.kv_start
    num_pieces = np.maximum(1, ceil_div(kv_len, piece_tokens))
    piece_len = ceil_div(ceil_div(kv_len, num_pieces), multiple) * multiple
    parent, index = index_within(num_pieces)
    items = tiles.take(parent)
    items.kv_start = items.kv_start + index * piece_len[parent]
    items.kv_end = np.minimum(items.kv_end, items.kv_start + piece_len[parent])
    items.mask_mode[(items.mask_mode == MASK_CAUSAL) & (items.first_position + 1 >= items.kv_end)] = MASK_NONE
    return items.take(np.nonzero(items.kv_end > items.kv_start)[0])


@dataclass
class _Merges:
    partial_base: np.ndarray  # [num_items] first partial slot of the item's rows, -1: written directly
    merge_tokens: np.ndarray  # rows with several parts
    merge_offsets: np.ndarray  # CSR into merge_slots
    merge_slots: np.ndarray


def _merges(q_start: np.ndarray, num_rows: np.ndarray, num_tokens: int) -> _Merges:
    """Parts (work items, then dense calls) as rows [q_start, q_start + num_rows): rows with
    exactly one part are written directly by it; the others get a partial slot per part and a
    merge list."""
    coverage = np.zeros(num_tokens + 1, np.int64)
    np.add.at(coverage, q_start, 1)
    np.add.at(coverage, q_start + num_rows, -1)
    parts_per_row = np.cumsum(coverage)[:num_tokens]
    multi = np.concatenate([[0], np.cumsum(parts_per_row != 1)])
    direct = (multi[q_start + num_rows] - multi[q_start]) == 0
    partial_count = np.where(direct, 0, num_rows)
    partial_base = np.where(direct, -1, np.cumsum(partial_count) - partial_count)
    slot_rows = flat_ranges(q_start[~direct], num_rows[~direct])
    slot_order = np.argsort(slot_rows, kind="stable")
    merge_tokens, first = np.unique(slot_rows[slot_order], return_index=True)
    return _Merges(partial_base, merge_tokens, np.concatenate([first, [slot_order.shape[0]]]), slot_order)


def _work_list(items: _Tiles, seg: Segments, partial_base: np.ndarray, tile: TileConfig, order: str) -> np.ndarray:
    """[num_items, WORK_FIELDS] int32 in `order` (largest estimated cost first within each class)."""
    work = np.zeros((items.segment.shape[0], WORK_FIELDS), np.int64)
    columns = {F_Q_START: items.q_start, F_Q_COUNT: items.num_rows, F_SEQ: seg.seq[items.segment],
               F_KV_START: items.kv_start, F_KV_END: items.kv_end, F_BASE_BLOCK: seg.base_block[items.segment],
               F_BASE_POS: seg.base_pos[items.segment], F_MASK_MODE: items.mask_mode,
               F_Q_POS0: items.first_position, F_PARTIAL_BASE: partial_base, F_SIZE_CLASS: items.size_class,
               F_KIND: seg.kind[items.segment]}
    for column_index, column in columns.items():
        work[:, column_index] = column
    cost = item_cost(items.kv_end - items.kv_start, items.size_class, tile)
    resolved = resolve_order(order, items.size_class, work[:, F_KIND])
    return work[order_items(cost, items.size_class, resolved)].astype(np.int32)


def build_prefix_shared_plan(
    query_start_loc,  # [num_seqs + 1] int
    seq_lens,  # [num_seqs] int
    shared_kv_lens,  # [num_seqs] int
    block_tables,  # [num_seqs, max_blocks] int
    group_ids=None,  # [num_seqs] int, -1 = no group, a group's seqs consecutive (None: no sharing, plain paged)
    is_prefix=None,  # [num_seqs] bool
    *,
    block_size: int,
    num_kv_heads: int,
    num_heads: int,
    head_dim: int = 128,
    tile: TileConfig | None = None,
    kv_split_tokens: int | None = None,  # fixed split-KV piece length (tests); None: sized from num_sms
    num_sms: int | None = None,  # the device's SM count (ops.plan_device.device_num_sms); needed unless kv_split_tokens
    programs_per_sm: int = 4,
    order: str | None = None,  # "cost" | "interleave" | "auto"; None = DEFAULT_WORK_ORDER
    num_lead_rows: int = 0,  # the first seqs, one row each, attended elsewhere (PrefixSharedPlan.lead_seq_lens)
) -> PrefixSharedPlan:
    order = DEFAULT_WORK_ORDER if order is None else order
    check(order in WORK_ORDERS, f"order must be one of {WORK_ORDERS}, got {order!r}")
    check(num_heads % num_kv_heads == 0, f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
    step = step_arrays(query_start_loc, seq_lens, shared_kv_lens, block_tables, group_ids, is_prefix)
    group_size = num_heads // num_kv_heads
    tile = tile or default_tile_config(head_dim, group_size)
    groups = step_groups(step)
    prefix_limit = row_prefix_limits(step, groups)
    squares = square_seqs(step, tile, block_size)
    carved = carved_seqs(step, groups, tile, squares)
    segments = carve_prefix_chunks(step_segments(step, groups, block_size), step, carved)
    if num_lead_rows:
        check(bool(np.all(step.num_rows[:num_lead_rows] == 1)) and not step.is_prefix[:num_lead_rows].any()
              and not step.shared_kv_lens[:num_lead_rows].any(),
              "lead rows must be one row per seq, sharing no KV")
        segments = segments.take(np.nonzero(segments.q_start >= num_lead_rows)[0])
    segments, dense = cut_dense_calls(segments, prefix_limit, tile, block_size, squares)
    tiles = _row_tiles(segments, prefix_limit, tile, group_size)
    piece_tokens = _kv_piece_tokens(tiles, tile, kv_split_tokens, num_sms, programs_per_sm, num_kv_heads)
    items = _split_kv(tiles, piece_tokens, tile.kv_split_multiple)
    num_items = items.q_start.shape[0]
    merges = _merges(np.concatenate([items.q_start, dense.q_start]), np.concatenate([items.num_rows, dense.num_rows]),
                     step.num_tokens)
    dense_calls = np.stack([dense.q_start, dense.num_rows, dense.seq, dense.first_block, dense.offset, dense.kv_len,
                            merges.partial_base[num_items:], dense.causal], axis=1).astype(np.int64)
    dense_calls = np.column_stack([dense_calls, batch_squares(dense_calls)])
    return PrefixSharedPlan(
        work=_work_list(items, segments, merges.partial_base[:num_items], tile, order), dense=dense_calls,
        block_tables=step.block_tables,
        prefix_limit=prefix_limit.astype(np.int32), merge_tokens=merges.merge_tokens.astype(np.int32),
        merge_offsets=merges.merge_offsets.astype(np.int32), merge_slots=merges.merge_slots.astype(np.int32),
        num_tokens=step.num_tokens, num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size,
        tile=tile, lead_seq_lens=step.seq_lens[:num_lead_rows].astype(np.int32))
