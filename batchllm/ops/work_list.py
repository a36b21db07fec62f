"""Host side of the fused prefix-shared attention: the int32 work list (BatchLLM section 5).

Built once per step with vectorised numpy from CPU copies of the step metadata (the same for
all layers). Each work item is one tile of one of two kinds, run for every KV head:

  prefix tile:   all query rows of a group in this step x the group's shared prefix KV
                 (a MatMul: rows x GQA heads packed into M); masked per row only where a row
                 sees less than the whole prefix (prefix-chunk rows being prefilled).
  distinct tile: one request's rows x its own KV range, causal by position.

Long KV ranges are split into pieces (split-KV) so the grid fills the GPU. Rows with several
parts (prefix + distinct, or split pieces) write float32 partials that a merge kernel combines
by log-sum-exp; rows with one part are written directly.

Work order (the launch grid runs items roughly in list order, KV head fastest):
  "cost"        all items by estimated cost, largest first (shortens the tail). In practice
                every BIG tile comes before every SMALL one: a compute phase, then a memory
                phase, close to two separate launches.
  "interleave"  BIG and SMALL items each by cost, largest first, then merged proportionally
                to their cumulative cost (key = cost of the class's items before this one /
                the class's total cost; stable, BIG first on ties). Every stretch of the grid
                holds both kinds in the ratio of their total work, so tensor-core tiles co-run
                with KV-streaming tiles on the same SMs (HFuse-style horizontal fusion), and
                both classes still end with their smallest items.
  "auto"        (the default) "interleave" when the step has BIG distinct tiles (prefill
                chunks: real compute to overlap with the decode rows' KV streaming), else
                "cost". Measured on the H200 (benchmarks/attention.py, 16 settings): interleave
                beat cost order on 7 of the 8 mixed settings (up to 5%, at most 1% worse on the
                8th) and lost up to 15% on pure decode, where the BIG tiles are light prefix
                tiles.
Estimated cost of an item (`item_cost`, one model for both classes, time units of one
KV token streamed): kv_len * (1 + m_pad / 128): the 1 is the KV read (the same bytes per
token for either tile), m_pad / 128 the MMA + softmax work of the padded packed rows (a BIG
tile, m_pad 64, does 4x the MMA work per KV token of a SMALL one, m_pad 16). Per KV token the
classes are thus weighted 1.5 : 1.125 rather than by raw FLOPs (4 : 1): at 64 packed rows a
BIG tile is still near the H200's memory/compute ridge, so neither term dominates. A rough
model on purpose; benchmarks/attention.py (fused vs fused_interleave) measures the orders.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchllm.ops.tile_config import TileConfig, default_tile_config
from batchllm.ops.validation import check

# Work-item fields (columns of the int32 work list).
F_Q_START, F_Q_COUNT, F_SEQ, F_KV_START, F_KV_END, F_BASE_BLOCK, F_BASE_POS = range(7)
F_MASK_MODE, F_Q_POS0, F_PARTIAL_BASE, F_SIZE_CLASS, F_KIND = range(7, 12)
WORK_FIELDS = 12
MASK_NONE, MASK_CAUSAL, MASK_ROW_LIMIT = 0, 1, 2
KIND_PREFIX, KIND_DISTINCT = 0, 1
SIZE_SMALL, SIZE_BIG = 0, 1
DEFAULT_NUM_SMS = 132  # H200
WORK_ORDERS = ("cost", "interleave", "auto")
# Order used when build_prefix_shared_plan gets no `order` (the engine's); see the docstring.
DEFAULT_WORK_ORDER = "auto"


def aligned_offsets(sizes) -> list[int]:
    """Starts of parts of `sizes` int32 each laid out in turn in one int32 buffer, every start
    16-byte aligned (Triton specialises pointer arguments on 16-byte alignment, so views at
    size-dependent offsets would compile new kernel variants mid-run); the last entry is the
    buffer's length."""
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + -(-int(size) // 4) * 4)
    return starts


def _as_numpy(x, dtype) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x).astype(dtype, copy=False)


def _flat_ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of arange(start, start + count) for each pair: [sum(counts)] int64."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + (np.arange(total) - offsets)


def _ceil_div(a, b):
    return -(-a // b)


def item_cost(kv_len, size_class, tile: TileConfig) -> np.ndarray:
    """Estimated cost of work items (see the module docstring): kv_len * (1 + m_pad / 128)."""
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
    """Permutation of work items for `order` ("cost" or "interleave", see the module docstring)."""
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
class PrefixSharedPlanOnDevice:
    """Device tensors of a plan (views into one int32 buffer: a single host-to-device copy)."""

    work: torch.Tensor  # [num_items, WORK_FIELDS] int32, all items (fused launch)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    prefix_limit: torch.Tensor  # [num_tokens] int32
    merge_tokens: torch.Tensor  # [num_merge_tokens] int32
    merge_offsets: torch.Tensor  # [num_merge_tokens + 1] int32
    merge_slots: torch.Tensor  # [num_partial_slots] int32
    num_partial_slots: int
    num_tokens: int
    num_heads: int
    num_kv_heads: int
    block_size: int
    tile: TileConfig
    # Persistent launch (CUDA graphs): a grid of `persistent_programs` programs runs the first
    # `num_items[0]` items of `work` (the rest is padding); with tile.split_classes, the first
    # num_items[0] of `work_big` and num_items[1] of `work_small`. 0: one program per item.
    num_items: torch.Tensor | None = None  # [1] (split_classes: [2]) int32 on the device
    persistent_programs: int = 0
    # tile.split_classes: the BIG and the SMALL items of `work`, each in work order
    work_big: torch.Tensor | None = None
    work_small: torch.Tensor | None = None


@dataclass
class PrefixSharedPlan:
    """Host (numpy) work list of one step; `.to(device)` once, reuse for every layer."""

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

    @property
    def num_partial_slots(self) -> int:
        return int(self.merge_slots.shape[0])

    def to(self, device) -> PrefixSharedPlanOnDevice:
        """One host-to-device copy."""
        parts = [self.work, self.block_tables, self.prefix_limit, self.merge_tokens, self.merge_offsets,
                 self.merge_slots]
        if self.tile.split_classes:
            big = self.work[:, F_SIZE_CLASS] == SIZE_BIG
            parts += [self.work[big], self.work[~big]]
        starts = aligned_offsets(p.size for p in parts)
        flat = np.zeros(starts[-1], np.int32)
        for p, start in zip(parts, starts):
            flat[start:start + p.size] = np.asarray(p, dtype=np.int32).ravel()
        buffer = torch.from_numpy(flat)
        if torch.device(device).type == "cuda":
            buffer = buffer.pin_memory().to(device, non_blocking=True)
        else:
            buffer = buffer.to(device)
        views = [buffer[start:start + p.size].view(p.shape) for p, start in zip(parts, starts)]
        by_class = views[6:]
        return PrefixSharedPlanOnDevice(
            *views[:6], work_big=by_class[0] if by_class else None, work_small=by_class[1] if by_class else None,
            num_partial_slots=self.num_partial_slots, num_tokens=self.num_tokens,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, block_size=self.block_size,
            tile=self.tile)


def build_prefix_shared_plan(
    query_start_loc,  # [num_seqs + 1] int
    seq_lens,  # [num_seqs] int
    shared_kv_lens,  # [num_seqs] int
    block_tables,  # [num_seqs, max_blocks] int
    group_ids=None,  # [num_seqs] int, -1 = no group (None: no sharing, plain paged)
    is_prefix=None,  # [num_seqs] bool
    *,
    block_size: int,
    num_kv_heads: int,
    num_heads: int,
    head_dim: int = 128,
    tile: TileConfig | None = None,
    kv_split_tokens: int | None = None,  # fixed split-KV piece length (tests); None = auto
    num_sms: int = DEFAULT_NUM_SMS,
    programs_per_sm: int = 4,
    order: str | None = None,  # "cost" | "interleave" | "auto"; None = DEFAULT_WORK_ORDER
) -> PrefixSharedPlan:
    """Build the step's work list (numpy in, numpy out). See the module docstring."""
    order = DEFAULT_WORK_ORDER if order is None else order
    check(order in WORK_ORDERS, f"order must be one of {WORK_ORDERS}, got {order!r}")
    qsl = _as_numpy(query_start_loc, np.int64)
    lens = _as_numpy(seq_lens, np.int64)
    shared = _as_numpy(shared_kv_lens, np.int64)
    tables = _as_numpy(block_tables, np.int32)
    num_seqs = lens.shape[0]
    groups = np.full(num_seqs, -1, np.int64) if group_ids is None else _as_numpy(group_ids, np.int64)
    prefix_seq = np.zeros(num_seqs, bool) if is_prefix is None else _as_numpy(is_prefix, bool)
    check(qsl.shape == (num_seqs + 1,), f"query_start_loc must be [num_seqs + 1], got {qsl.shape}")
    check(shared.shape == groups.shape == prefix_seq.shape == (num_seqs,), "per-seq arrays differ in length")
    check(tables.ndim == 2 and tables.shape[0] == num_seqs, f"block_tables must be [num_seqs, max_blocks], got {tables.shape}")
    check(num_heads % num_kv_heads == 0, f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
    group_size = num_heads // num_kv_heads
    tile = tile or default_tile_config(head_dim, group_size)
    num_tokens = int(qsl[-1]) if num_seqs else 0
    q_lens = qsl[1:] - qsl[:-1]
    check(bool(np.all(q_lens >= 0)) and bool(np.all(lens >= q_lens)), "need 0 <= q_len <= seq_len per seq")
    pos0 = lens - q_lens  # position of each seq's first row
    own_block0 = _ceil_div(shared, block_size)  # block-table index of position shared_kv_len

    # --- groups: prefix length P_g, representative seq, row range (rows are laid out group by group)
    grouped = np.nonzero(groups >= 0)[0]
    group_keys, group_of = np.unique(groups[grouped], return_inverse=True)
    num_groups = group_keys.shape[0]
    prefix_len = np.zeros(num_groups, np.int64)
    np.maximum.at(prefix_len, group_of, np.where(prefix_seq[grouped], lens[grouped], shared[grouped]))
    rep_seq = np.full(num_groups, num_seqs, np.int64)
    np.minimum.at(rep_seq, group_of, grouped)
    row_begin = np.full(num_groups, num_tokens, np.int64)
    row_end = np.zeros(num_groups, np.int64)
    np.minimum.at(row_begin, group_of, qsl[grouped])
    np.maximum.at(row_end, group_of, qsl[grouped + 1])

    # --- per-row visible prefix length (prefix-chunk rows: causal; members: their shared part)
    token_seq = np.repeat(np.arange(num_seqs), q_lens)
    token_pos = pos0[token_seq] + (np.arange(num_tokens) - qsl[token_seq])
    seq_prefix_len = np.zeros(num_seqs, np.int64)
    seq_prefix_len[grouped] = prefix_len[group_of]
    tok_p = seq_prefix_len[token_seq]
    prefix_limit = np.where(prefix_seq[token_seq], np.minimum(token_pos + 1, tok_p),
                            np.minimum(shared[token_seq], tok_p))

    # --- segments: (q_start, q_count, seq, kv_start, kv_end, base_block, base_pos, mask, q_pos0, kind)
    segs = []
    has_prefix = (prefix_len > 0) & (row_end > row_begin)
    g = np.nonzero(has_prefix)[0]
    zeros = np.zeros(g.shape[0], np.int64)
    segs.append(np.stack([row_begin[g], row_end[g] - row_begin[g], rep_seq[g], zeros, prefix_len[g], zeros,
                          zeros, np.full_like(zeros, MASK_ROW_LIMIT), zeros, np.full_like(zeros, KIND_PREFIX)], 1))
    active = q_lens > 0
    in_group = groups >= 0
    # own KV [shared, seq_len) of every non-prefix seq
    s = np.nonzero(active & ~(in_group & prefix_seq) & (lens > shared))[0]
    segs.append(np.stack([qsl[s], q_lens[s], s, shared[s], lens[s], own_block0[s], shared[s],
                          np.full_like(s, MASK_CAUSAL), pos0[s], np.full_like(s, KIND_DISTINCT)], 1))
    # ungrouped seqs that still read shared blocks: [0, shared) is their own distinct part here
    s = np.nonzero(active & ~in_group & (shared > 0))[0]
    zeros = np.zeros(s.shape[0], np.int64)
    segs.append(np.stack([qsl[s], q_lens[s], s, zeros, np.minimum(shared[s], lens[s]), zeros, zeros,
                          np.full_like(s, MASK_CAUSAL), pos0[s], np.full_like(s, KIND_DISTINCT)], 1))
    seg = np.concatenate(segs, 0).astype(np.int64).reshape(-1, 10)
    (sq_start, sq_count, s_seq, s_kv_start, s_kv_end, s_base_block, s_base_pos, s_mask, s_pos0,
     s_kind) = seg.T

    # --- row tiles: GQA heads of one KV head packed with rows into M
    small_rows = max(1, tile.small_m // group_size)
    big_rows = max(1, tile.big_m // group_size)
    rows_per_tile = np.where(sq_count <= small_rows, small_rows, big_rows)
    n_tiles = _ceil_div(sq_count, rows_per_tile)
    t_seg = np.repeat(np.arange(seg.shape[0]), n_tiles)
    t_index = np.arange(t_seg.shape[0]) - np.repeat(np.cumsum(n_tiles) - n_tiles, n_tiles)
    t_q_start = sq_start[t_seg] + t_index * rows_per_tile[t_seg]
    t_q_count = np.minimum(rows_per_tile[t_seg], sq_count[t_seg] - t_index * rows_per_tile[t_seg])
    t_pos0 = s_pos0[t_seg] + t_index * rows_per_tile[t_seg]
    t_kv_start, t_kv_end, t_mask = s_kv_start[t_seg], s_kv_end[t_seg].copy(), s_mask[t_seg].copy()
    # causal: clip KV to the tile's last row; no mask when the first row sees the whole range
    causal = t_mask == MASK_CAUSAL
    t_kv_end[causal] = np.minimum(t_kv_end[causal], t_pos0[causal] + t_q_count[causal])
    t_mask[causal & (t_pos0 + 1 >= t_kv_end)] = MASK_NONE
    # row limits on prefix tiles: clip to the largest, mask only if some row sees less
    lim = np.nonzero(t_mask == MASK_ROW_LIMIT)[0]
    if lim.size:
        rows = _flat_ranges(t_q_start[lim], t_q_count[lim])
        starts = np.cumsum(t_q_count[lim]) - t_q_count[lim]
        lo = np.minimum.reduceat(prefix_limit[rows], starts)
        hi = np.maximum.reduceat(prefix_limit[rows], starts)
        t_kv_end[lim] = np.minimum(t_kv_end[lim], hi)
        t_mask[lim[lo >= t_kv_end[lim]]] = MASK_NONE
    keep = t_kv_end > t_kv_start
    t_seg, t_q_start, t_q_count, t_pos0 = t_seg[keep], t_q_start[keep], t_q_count[keep], t_pos0[keep]
    t_kv_start, t_kv_end, t_mask = t_kv_start[keep], t_kv_end[keep], t_mask[keep]
    t_size = np.where(t_q_count * group_size <= tile.small_m, SIZE_SMALL, SIZE_BIG)

    # --- split-KV: equal pieces, multiples of the KV step, enough programs to fill the GPU
    kv_len = t_kv_end - t_kv_start
    multiple = tile.kv_split_multiple
    if kv_split_tokens is None:
        target_items = max(1, num_sms * programs_per_sm // num_kv_heads)
        piece = max(tile.min_kv_split_tokens, int(_ceil_div(int(kv_len.sum()), target_items)) if kv_len.size else 1)
    else:
        piece = kv_split_tokens
    piece = int(_ceil_div(piece, multiple) * multiple)
    n_pieces = np.maximum(1, _ceil_div(kv_len, piece))
    piece_len = _ceil_div(_ceil_div(kv_len, n_pieces), multiple) * multiple
    i_tile = np.repeat(np.arange(kv_len.shape[0]), n_pieces)
    i_index = np.arange(i_tile.shape[0]) - np.repeat(np.cumsum(n_pieces) - n_pieces, n_pieces)
    i_kv_start = t_kv_start[i_tile] + i_index * piece_len[i_tile]
    i_kv_end = np.minimum(t_kv_end[i_tile], i_kv_start + piece_len[i_tile])
    i_seg = t_seg[i_tile]
    i_q_start, i_q_count, i_pos0 = t_q_start[i_tile], t_q_count[i_tile], t_pos0[i_tile]
    i_mask = t_mask[i_tile].copy()
    i_mask[(i_mask == MASK_CAUSAL) & (i_pos0 + 1 >= i_kv_end)] = MASK_NONE
    keep = i_kv_end > i_kv_start  # pieces past a causal tile's last row vanish
    sel = np.nonzero(keep)[0]
    i_tile, i_seg, i_q_start, i_q_count, i_pos0 = i_tile[sel], i_seg[sel], i_q_start[sel], i_q_count[sel], i_pos0[sel]
    i_kv_start, i_kv_end, i_mask = i_kv_start[sel], i_kv_end[sel], i_mask[sel]
    i_size = t_size[i_tile]

    # --- direct write vs partial: rows with exactly one part skip the merge
    num_items = i_seg.shape[0]
    coverage = np.zeros(num_tokens + 1, np.int64)
    np.add.at(coverage, i_q_start, 1)
    np.add.at(coverage, i_q_start + i_q_count, -1)
    parts_per_token = np.cumsum(coverage)[:num_tokens]
    multi = np.concatenate([[0], np.cumsum(parts_per_token != 1)])
    direct = (multi[i_q_start + i_q_count] - multi[i_q_start]) == 0
    partial_count = np.where(direct, 0, i_q_count)
    partial_base = np.where(direct, -1, np.cumsum(partial_count) - partial_count)
    slot_tokens = _flat_ranges(i_q_start[~direct], i_q_count[~direct])
    slot_order = np.argsort(slot_tokens, kind="stable")
    merge_tokens, first = np.unique(slot_tokens[slot_order], return_index=True)
    merge_offsets = np.concatenate([first, [slot_order.shape[0]]])

    # --- the work list in `order` (largest estimated cost first within each class, section 5)
    cost = item_cost(i_kv_end - i_kv_start, i_size, tile)
    work = np.zeros((num_items, WORK_FIELDS), np.int64)
    work[:, F_Q_START], work[:, F_Q_COUNT], work[:, F_SEQ] = i_q_start, i_q_count, s_seq[i_seg]
    work[:, F_KV_START], work[:, F_KV_END] = i_kv_start, i_kv_end
    work[:, F_BASE_BLOCK], work[:, F_BASE_POS] = s_base_block[i_seg], s_base_pos[i_seg]
    work[:, F_MASK_MODE], work[:, F_Q_POS0], work[:, F_PARTIAL_BASE] = i_mask, i_pos0, partial_base
    work[:, F_SIZE_CLASS], work[:, F_KIND] = i_size, s_kind[i_seg]
    work = work[order_items(cost, i_size, resolve_order(order, i_size, s_kind[i_seg]))].astype(np.int32)
    return PrefixSharedPlan(
        work=work, block_tables=tables, prefix_limit=prefix_limit.astype(np.int32),
        merge_tokens=merge_tokens.astype(np.int32), merge_offsets=merge_offsets.astype(np.int32),
        merge_slots=slot_order.astype(np.int32), num_tokens=num_tokens,
        num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size, tile=tile)
