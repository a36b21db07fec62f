"""Host side of the fused prefix-shared attention: the int32 work list (BatchLLM section 5).

Built once per step with vectorised numpy from CPU copies of the step metadata (the same for
all layers). The tiles, split-KV pieces, merges, work orders and the cost model of `item_cost`:
docs/design.md ("Prefix-shared attention").
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import torch

from batchllm.ops.plan_layout import PLAN_ARRAYS, step_layout
from batchllm.ops.tile_config import TileConfig, default_tile_config
from batchllm.ops.transfer import to_device
from batchllm.ops.validation import check

# Work-item fields (columns of the int32 work list).
F_Q_START, F_Q_COUNT, F_SEQ, F_KV_START, F_KV_END, F_BASE_BLOCK, F_BASE_POS = range(7)
F_MASK_MODE, F_Q_POS0, F_PARTIAL_BASE, F_SIZE_CLASS, F_KIND = range(7, 12)
WORK_FIELDS = 12
MASK_NONE, MASK_CAUSAL, MASK_ROW_LIMIT = 0, 1, 2
KIND_PREFIX, KIND_DISTINCT = 0, 1
SIZE_SMALL, SIZE_BIG = 0, 1
WORK_ORDERS = ("cost", "interleave", "auto")
DENSE_FIELDS = 9  # columns of a plan's dense calls (PrefixSharedPlan.dense)
# Order used when build_prefix_shared_plan gets no `order` (the engine's).
DEFAULT_WORK_ORDER = "auto"


def device_num_sms(device, cpu_num_sms: int = 8) -> int:
    """Streaming multiprocessors of a CUDA device: split-KV pieces are sized so that the launch
    fills them. `cpu_num_sms` stands in where there is no GPU (the Triton interpreter runs the
    programs one after another, so a few pieces per range are enough there)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return cpu_num_sms


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


def _index_within(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each of `counts[i]` copies of i: (parent i, index 0..counts[i]-1 within it)."""
    parent = np.repeat(np.arange(counts.shape[0]), counts)
    return parent, np.arange(parent.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts)


def _ceil_div(a, b):
    return -(-a // b)


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


@dataclass(frozen=True)
class DenseCall:
    """One dense call of a plan on the device (work_list._dense_calls): rows [q_start, q_start +
    q_count) x the kv_len positions that start `offset` into the cache blocks `blocks` (a view of
    the plan's block tables); its rows' outputs go to partial slots from partial_base (-1: to
    the output itself). causal: row i sees the first i + 1 positions (q_count == kv_len). A
    batch of `batch` causal squares: rows [q_start, q_start + q_count) are batch squares of kv_len
    rows each, whose blocks (each its own `offset`-shifted run of blocks) follow one another in
    `blocks`."""

    q_start: int
    q_count: int
    blocks: torch.Tensor
    offset: int
    kv_len: int
    partial_base: int
    causal: bool = False
    batch: int = 1


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
    # the plan's dense calls, launched from the host (their blocks cut once per step)
    dense: tuple[DenseCall, ...] = ()


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
    # [num_dense_calls, DENSE_FIELDS] int64: rows [q_start, q_start + q_count) x the kv_len
    # positions that start `offset` into block-table entry first_block of row `seq`, as one
    # dense attention call whose outputs go to partial slots from partial_base, causal (1) or
    # unmasked (0) (_dense_calls); batch: at the first call of a batch of causal calls run as one
    # (_batch_squares) the number of calls it holds, 0 for the others, 1 for a call alone
    dense: np.ndarray = field(default_factory=lambda: np.zeros((0, DENSE_FIELDS), np.int64))

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

    def to(self, device) -> PrefixSharedPlanOnDevice:
        """One host-to-device copy of every array (laid out by plan_layout.step_layout)."""
        arrays = {name: np.asarray(getattr(self, name), dtype=np.int32) for name in PLAN_ARRAYS}
        if self.tile.split_classes:
            arrays["work_big"], arrays["work_small"] = self.class_lists()
        layout = step_layout(arrays)
        buffer = to_device(layout.pack(arrays), torch.device(device))
        views = layout.views(buffer)
        return PrefixSharedPlanOnDevice(
            **views, num_partial_slots=self.num_partial_slots, num_tokens=self.num_tokens,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, block_size=self.block_size, tile=self.tile,
            dense=self._dense_calls_on(views["block_tables"]))

    def _dense_calls_on(self, block_tables: torch.Tensor) -> tuple[DenseCall, ...]:
        """The dense calls with their blocks cut from the device block tables."""
        calls, rows = [], self.dense.tolist()
        for index, (q_start, _, _, _, offset, kv_len, partial_base, causal, batch) in enumerate(rows):
            if batch == 0:
                continue  # in the batch of an earlier call
            num_blocks = _ceil_div(offset + kv_len, self.block_size)
            runs = [block_tables[seq, first:first + num_blocks] for _, _, seq, first, *_ in rows[index:index + batch]]
            calls.append(DenseCall(q_start, sum(row[1] for row in rows[index:index + batch]),
                                   runs[0] if batch == 1 else torch.cat(runs), offset, kv_len, partial_base,
                                   bool(causal), batch))
        return tuple(calls)


class _Columns:
    """Equal-length numpy columns (a dataclass's fields); `take` selects rows of all of them."""

    def take(self, rows):
        return type(self)(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})


@dataclass
class _Step:
    """The step's per-seq metadata as int64 / bool numpy arrays."""

    query_start_loc: np.ndarray  # [num_seqs + 1]
    seq_lens: np.ndarray  # [num_seqs]
    shared_kv_lens: np.ndarray  # [num_seqs]
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32
    group_ids: np.ndarray  # [num_seqs], -1: no group
    is_prefix: np.ndarray  # [num_seqs] bool
    num_rows: np.ndarray  # [num_seqs] query rows
    first_positions: np.ndarray  # [num_seqs] position of each seq's first row
    num_seqs: int
    num_tokens: int


def _step_arrays(query_start_loc, seq_lens, shared_kv_lens, block_tables, group_ids, is_prefix) -> _Step:
    qsl, lens = _as_numpy(query_start_loc, np.int64), _as_numpy(seq_lens, np.int64)
    num_seqs = lens.shape[0]
    check(qsl.shape == (num_seqs + 1,), f"query_start_loc must be [num_seqs + 1], got {qsl.shape}")
    num_rows = qsl[1:] - qsl[:-1]
    step = _Step(
        qsl, lens, _as_numpy(shared_kv_lens, np.int64), _as_numpy(block_tables, np.int32),
        np.full(num_seqs, -1, np.int64) if group_ids is None else _as_numpy(group_ids, np.int64),
        np.zeros(num_seqs, bool) if is_prefix is None else _as_numpy(is_prefix, bool),
        num_rows, lens - num_rows, num_seqs, int(qsl[-1]) if num_seqs else 0)
    check(step.shared_kv_lens.shape == step.group_ids.shape == step.is_prefix.shape == (num_seqs,),
          "per-seq arrays differ in length")
    check(step.block_tables.ndim == 2 and step.block_tables.shape[0] == num_seqs,
          f"block_tables must be [num_seqs, max_blocks], got {step.block_tables.shape}")
    check(bool(np.all(num_rows >= 0)) and bool(np.all(lens >= num_rows)), "need 0 <= q_len <= seq_len per seq")
    return step


@dataclass
class _Groups:
    """The step's prefix-sharing groups (rows are laid out group by group)."""

    grouped_seqs: np.ndarray  # seqs that belong to a group
    group_of_seq: np.ndarray  # [len(grouped_seqs)] group index of each
    prefix_len: np.ndarray  # [num_groups] shared prefix KV positions P_g
    representative_seq: np.ndarray  # [num_groups] the seq whose block table holds the prefix
    row_begin: np.ndarray  # [num_groups] first query row of the group
    row_end: np.ndarray  # [num_groups] one past its last row


def _groups(step: _Step) -> _Groups:
    grouped = np.nonzero(step.group_ids >= 0)[0]
    group_of = np.unique(step.group_ids[grouped], return_inverse=True)[1].reshape(-1)
    num_groups = int(group_of.max()) + 1 if group_of.size else 0
    prefix_len = np.zeros(num_groups, np.int64)
    np.maximum.at(prefix_len, group_of,
                  np.where(step.is_prefix[grouped], step.seq_lens[grouped], step.shared_kv_lens[grouped]))
    representative = np.full(num_groups, step.num_seqs, np.int64)
    np.minimum.at(representative, group_of, grouped)
    row_begin = np.full(num_groups, step.num_tokens, np.int64)
    row_end = np.zeros(num_groups, np.int64)
    np.minimum.at(row_begin, group_of, step.query_start_loc[grouped])
    np.maximum.at(row_end, group_of, step.query_start_loc[grouped + 1])
    return _Groups(grouped, group_of, prefix_len, representative, row_begin, row_end)


def _row_prefix_limits(step: _Step, groups: _Groups) -> np.ndarray:
    """[num_tokens] prefix KV positions each row sees: prefix-chunk rows causally, members their
    shared part, at most the group's prefix (0 outside groups)."""
    row_seq = np.repeat(np.arange(step.num_seqs), step.num_rows)
    row_position = step.first_positions[row_seq] + (np.arange(step.num_tokens) - step.query_start_loc[row_seq])
    seq_prefix_len = np.zeros(step.num_seqs, np.int64)
    seq_prefix_len[groups.grouped_seqs] = groups.prefix_len[groups.group_of_seq]
    row_prefix_len = seq_prefix_len[row_seq]
    return np.where(step.is_prefix[row_seq], np.minimum(row_position + 1, row_prefix_len),
                    np.minimum(step.shared_kv_lens[row_seq], row_prefix_len))


@dataclass
class _Segments(_Columns):
    """Rows x KV ranges before tiling: one per group prefix and per seq's own KV."""

    q_start: np.ndarray
    num_rows: np.ndarray
    seq: np.ndarray  # whose block table addresses the KV
    kv_start: np.ndarray
    kv_end: np.ndarray
    base_block: np.ndarray  # block-table index of base_pos
    base_pos: np.ndarray
    mask_mode: np.ndarray
    first_position: np.ndarray  # position of the first row (causal masks)
    kind: np.ndarray


def _segments(step: _Step, groups: _Groups, block_size: int) -> _Segments:
    """Prefix segments (a group's rows x its prefix, row limits) and distinct segments (a seq's
    rows x its own KV, causal; ungrouped seqs that still read shared blocks also x [0, shared))."""
    g = np.nonzero((groups.prefix_len > 0) & (groups.row_end > groups.row_begin))[0]
    zeros = np.zeros(g.shape[0], np.int64)
    prefix = _Segments(groups.row_begin[g], groups.row_end[g] - groups.row_begin[g], groups.representative_seq[g],
                       zeros, groups.prefix_len[g], zeros, zeros, zeros + MASK_ROW_LIMIT, zeros,
                       zeros + KIND_PREFIX)
    qsl, lens, shared, num_rows = step.query_start_loc, step.seq_lens, step.shared_kv_lens, step.num_rows
    active, in_group = num_rows > 0, step.group_ids >= 0
    s = np.nonzero(active & ~(in_group & step.is_prefix) & (lens > shared))[0]  # own KV [shared, seq_len)
    own = _Segments(qsl[s], num_rows[s], s, shared[s], lens[s], _ceil_div(shared[s], block_size), shared[s],
                    np.full_like(s, MASK_CAUSAL), step.first_positions[s], np.full_like(s, KIND_DISTINCT))
    s = np.nonzero(active & ~in_group & (shared > 0))[0]  # [0, shared) of ungrouped seqs
    zeros = np.zeros(s.shape[0], np.int64)
    shared_part = _Segments(qsl[s], num_rows[s], s, zeros, np.minimum(shared[s], lens[s]), zeros, zeros,
                            np.full_like(s, MASK_CAUSAL), step.first_positions[s], np.full_like(s, KIND_DISTINCT))
    return _concat_segments([prefix, own, shared_part])


def _concat_segments(parts: list[_Segments]) -> _Segments:
    return _Segments(**{f.name: np.concatenate([getattr(p, f.name) for p in parts]).astype(np.int64)
                        for f in fields(_Segments)})


def _square_seqs(step: _Step, tile: TileConfig, block_size: int) -> np.ndarray:
    """[num_seqs] bool: the seqs whose chunk's own positions run as a causal dense call.

    A chunk of at least tile.dense_min_rows rows whose own KV starts at or before its first row
    (a group's prefix chunk, or a chunk at or after its shared KV) sees its own positions as a
    causal square. Squares of equal rows and block offset on consecutive rows can run as one
    batched call, and a call is worth its host cost from tile.causal_square_rows() rows in all
    (tile_config.py): the squares of such runs are chosen."""
    chosen = np.zeros(step.num_seqs, bool)
    min_rows = tile.causal_square_rows()
    if min_rows <= 0:
        return chosen
    own_start = np.where((step.group_ids >= 0) & step.is_prefix, 0, step.shared_kv_lens)
    s = np.nonzero((step.num_rows >= tile.dense_min_rows) & (step.first_positions >= own_start))[0]
    if s.size == 0:
        return chosen
    rows, offsets, starts = step.num_rows[s], (step.first_positions[s] - own_start[s]) % block_size, step.query_start_loc[s]
    joins = (rows[1:] == rows[:-1]) & (offsets[1:] == offsets[:-1]) & (starts[1:] == starts[:-1] + rows[:-1])
    run = np.cumsum(np.concatenate([[True], ~joins])) - 1
    chosen[s[np.bincount(run, weights=rows)[run] >= min_rows]] = True
    return chosen


def _carve_prefix_chunks(seg: _Segments, step: _Step, squares: np.ndarray) -> _Segments:
    """The prefix chunks among `squares` leave their group's segment.

    A group's prefix chunk shares its group's segment with the members' rows, and its rows'
    limits make it causal over the chunk's own positions. For its causal call (_dense_calls)
    such a chunk becomes a causal segment of its own over its seq's KV, and the members' rows
    before and after it stay one row-limit segment each."""
    chunks = np.nonzero(squares & (step.group_ids >= 0) & step.is_prefix)[0]
    for s in chunks.tolist():
        begin, end = int(step.query_start_loc[s]), int(step.query_start_loc[s + 1])
        seg_end = seg.q_start + seg.num_rows
        j = int(np.nonzero((seg.mask_mode == MASK_ROW_LIMIT) & (seg.q_start <= begin) & (seg_end >= end))[0][0])
        before, after = seg.take([j]), seg.take([j])
        before.num_rows = np.array([begin - seg.q_start[j]])
        after.q_start, after.num_rows = np.array([end]), np.array([seg_end[j] - end])
        one = np.ones(1, np.int64)
        chunk = _Segments(one * begin, one * (end - begin), one * s, one * 0, one * step.seq_lens[s], one * 0, one * 0,
                          one * MASK_CAUSAL, one * step.first_positions[s], one * KIND_PREFIX)
        rest = seg.take(np.arange(seg.q_start.shape[0]) != j)
        seg = _concat_segments([rest] + [part for part in (before, chunk, after) if part.num_rows[0] > 0])
    return seg


@dataclass
class _Dense(_Columns):
    """Dense calls before partial slots: per call its rows and KV range (see _dense_calls)."""

    q_start: np.ndarray
    num_rows: np.ndarray
    seq: np.ndarray
    first_block: np.ndarray
    offset: np.ndarray
    kv_len: np.ndarray
    causal: np.ndarray


def _dense_range(seg: _Segments, rows: np.ndarray, kv_start: np.ndarray, kv_len: np.ndarray, causal: int,
                 block_size: int) -> _Dense:
    rel = kv_start - seg.base_pos[rows]
    return _Dense(seg.q_start[rows], seg.num_rows[rows], seg.seq[rows], seg.base_block[rows] + rel // block_size,
                  rel % block_size, kv_len, np.full(rows.shape[0], causal, np.int64))


def _dense_calls(seg: _Segments, prefix_limit: np.ndarray, tile: TileConfig, block_size: int,
                 squares: np.ndarray) -> tuple[_Segments, _Dense]:
    """Dense calls: the KV that every row of a segment sees, cut off the segment's front, and
    the causal square of a long prefill chunk's own positions.

    A prefill chunk's rows all see their group's prefix up to the least row limit (members: the
    whole prefix), or their own context before the chunk (causal: up to the first row's
    position). That block is plain dense attention, rows x KV with no mask: a library kernel
    runs it on the gathered blocks faster than the BIG tiles (tile_config.py), and its output
    and log-sum-exp join the row's other parts in the merge. Segments of at least
    tile.dense_min_rows rows whose block holds at least tile.dense_min_tokens positions get one.
    The own segment of a seq in `squares` (_square_seqs) also gets a causal call over the chunk's
    own positions (row i sees the first i + 1), which the library kernel runs with its causal
    mask. The rest of each segment stays in the work list. Returns (segments, calls: the
    unmasked ones, then the causal ones, each in row order)."""
    none = _Dense(*(np.zeros(0, np.int64) for _ in fields(_Dense)))
    if tile.dense_min_rows <= 0 or seg.q_start.size == 0:
        return seg, none
    causal = seg.mask_mode == MASK_CAUSAL
    square = np.nonzero(causal & squares[seg.seq] & (seg.first_position >= seg.kv_start)
                        & (seg.kv_end == seg.first_position + seg.num_rows))[0]
    visible = np.where(causal, seg.first_position + 1, seg.kv_end)
    visible[square] = seg.first_position[square]  # the context only: the square is a call of its own
    limited = np.nonzero((seg.mask_mode == MASK_ROW_LIMIT) & (seg.num_rows > 0))[0]
    if limited.size:
        rows = _flat_ranges(seg.q_start[limited], seg.num_rows[limited])
        visible[limited] = np.minimum.reduceat(prefix_limit[rows], np.cumsum(seg.num_rows[limited])
                                               - seg.num_rows[limited])
    dense_end = np.minimum(seg.kv_end, visible)
    chosen = np.nonzero((seg.num_rows >= tile.dense_min_rows)
                        & (dense_end - seg.kv_start >= tile.dense_min_tokens))[0]
    if chosen.size == 0 and square.size == 0:
        return seg, none
    calls = _concat_dense([
        _dense_range(seg, chosen, seg.kv_start[chosen], dense_end[chosen] - seg.kv_start[chosen], 0, block_size),
        _dense_range(seg, square, seg.first_position[square], seg.num_rows[square], 1, block_size)])
    seg.kv_start = seg.kv_start.copy()
    seg.kv_start[chosen] = dense_end[chosen]
    seg.kv_end = seg.kv_end.copy()
    seg.kv_end[square] = seg.first_position[square]
    return seg, calls.take(np.lexsort((calls.q_start, calls.causal)))


def _batch_squares(dense: np.ndarray) -> np.ndarray:
    """[num_calls] the `batch` column: consecutive causal calls of equal length and block offset
    on consecutive rows whose partial slots follow one another (or that have none) run as one
    call of the library kernel with a batch dimension, which costs the host what one call
    costs. At a batch's first call: the number of calls it holds; 0 at the others."""
    batch = np.ones(dense.shape[0], np.int64)
    first = 0
    for index in range(1, dense.shape[0]):
        q_start, q_count, _, _, offset, kv_len, base, causal = dense[index, :8].tolist()
        before = dense[index - 1]
        joins = (causal and before[7] and kv_len == before[5] and offset == before[4]
                 and q_start == before[0] + before[1]
                 and (base == before[6] == -1 or (base >= 0 and before[6] >= 0 and base == before[6] + before[1])))
        if joins:
            batch[first] += 1
            batch[index] = 0
        else:
            first = index
    return batch


def _concat_dense(parts: list[_Dense]) -> _Dense:
    return _Dense(**{f.name: np.concatenate([getattr(p, f.name) for p in parts]).astype(np.int64)
                     for f in fields(_Dense)})


@dataclass
class _Tiles(_Columns):
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


def _row_tiles(seg: _Segments, prefix_limit: np.ndarray, tile: TileConfig, group_size: int) -> _Tiles:
    """Cut segments into row tiles; clip each tile's KV to what its rows see and drop the masks
    that no row needs."""
    small_rows, big_rows = max(1, tile.small_m // group_size), max(1, tile.big_m // group_size)
    rows_per_tile = np.where(seg.num_rows <= small_rows, small_rows, big_rows)
    segment, index = _index_within(_ceil_div(seg.num_rows, rows_per_tile))
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
        rows = _flat_ranges(tiles.q_start[limited], tiles.num_rows[limited])
        starts = np.cumsum(tiles.num_rows[limited]) - tiles.num_rows[limited]
        least = np.minimum.reduceat(prefix_limit[rows], starts)
        most = np.maximum.reduceat(prefix_limit[rows], starts)
        tiles.kv_end[limited] = np.minimum(tiles.kv_end[limited], most)
        tiles.mask_mode[limited[least >= tiles.kv_end[limited]]] = MASK_NONE
    tiles = tiles.take(np.nonzero(tiles.kv_end > tiles.kv_start)[0])
    tiles.size_class = np.where(tiles.num_rows * group_size <= tile.small_m, SIZE_SMALL, SIZE_BIG)
    return tiles


def _kv_piece_tokens(tiles: _Tiles, tile: TileConfig, kv_split_tokens: int | None, num_sms: int | None,
                     programs_per_sm: int, num_kv_heads: int) -> int:
    """Split-KV piece length: fixed, or enough items to fill the GPU (num_sms x programs_per_sm
    programs), never below tile.min_kv_split_tokens; a multiple of the KV step."""
    if kv_split_tokens is None:
        check(num_sms is not None, "num_sms (the device's SM count, see device_num_sms) or kv_split_tokens is needed")
        kv_len = tiles.kv_end - tiles.kv_start
        target_items = max(1, num_sms * programs_per_sm // num_kv_heads)
        piece = max(tile.min_kv_split_tokens, int(_ceil_div(int(kv_len.sum()), target_items)) if kv_len.size else 1)
    else:
        piece = kv_split_tokens
    return int(_ceil_div(piece, tile.kv_split_multiple) * tile.kv_split_multiple)


def _split_kv(tiles: _Tiles, piece_tokens: int, multiple: int) -> _Tiles:
    """Each tile's KV range in equal pieces (multiples of the KV step) of at most piece_tokens;
    pieces past a causal tile's last row vanish."""
    kv_len = tiles.kv_end - tiles.kv_start
    num_pieces = np.maximum(1, _ceil_div(kv_len, piece_tokens))
    piece_len = _ceil_div(_ceil_div(kv_len, num_pieces), multiple) * multiple
    parent, index = _index_within(num_pieces)
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
    slot_rows = _flat_ranges(q_start[~direct], num_rows[~direct])
    slot_order = np.argsort(slot_rows, kind="stable")
    merge_tokens, first = np.unique(slot_rows[slot_order], return_index=True)
    return _Merges(partial_base, merge_tokens, np.concatenate([first, [slot_order.shape[0]]]), slot_order)


def _work_list(items: _Tiles, seg: _Segments, partial_base: np.ndarray, tile: TileConfig, order: str) -> np.ndarray:
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
    group_ids=None,  # [num_seqs] int, -1 = no group (None: no sharing, plain paged)
    is_prefix=None,  # [num_seqs] bool
    *,
    block_size: int,
    num_kv_heads: int,
    num_heads: int,
    head_dim: int = 128,
    tile: TileConfig | None = None,
    kv_split_tokens: int | None = None,  # fixed split-KV piece length (tests); None: sized from num_sms
    num_sms: int | None = None,  # the device's SM count (device_num_sms); needed unless kv_split_tokens
    programs_per_sm: int = 4,
    order: str | None = None,  # "cost" | "interleave" | "auto"; None = DEFAULT_WORK_ORDER
) -> PrefixSharedPlan:
    order = DEFAULT_WORK_ORDER if order is None else order
    check(order in WORK_ORDERS, f"order must be one of {WORK_ORDERS}, got {order!r}")
    check(num_heads % num_kv_heads == 0, f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
    step = _step_arrays(query_start_loc, seq_lens, shared_kv_lens, block_tables, group_ids, is_prefix)
    group_size = num_heads // num_kv_heads
    tile = tile or default_tile_config(head_dim, group_size)
    groups = _groups(step)
    prefix_limit = _row_prefix_limits(step, groups)
    squares = _square_seqs(step, tile, block_size)
    segments = _carve_prefix_chunks(_segments(step, groups, block_size), step, squares)
    segments, dense = _dense_calls(segments, prefix_limit, tile, block_size, squares)
    tiles = _row_tiles(segments, prefix_limit, tile, group_size)
    piece_tokens = _kv_piece_tokens(tiles, tile, kv_split_tokens, num_sms, programs_per_sm, num_kv_heads)
    items = _split_kv(tiles, piece_tokens, tile.kv_split_multiple)
    num_items = items.q_start.shape[0]
    merges = _merges(np.concatenate([items.q_start, dense.q_start]), np.concatenate([items.num_rows, dense.num_rows]),
                     step.num_tokens)
    dense_calls = np.stack([dense.q_start, dense.num_rows, dense.seq, dense.first_block, dense.offset, dense.kv_len,
                            merges.partial_base[num_items:], dense.causal, dense.causal], axis=1).astype(np.int64)
    dense_calls[:, 8] = _batch_squares(dense_calls)
    return PrefixSharedPlan(
        work=_work_list(items, segments, merges.partial_base[:num_items], tile, order), dense=dense_calls,
        block_tables=step.block_tables,
        prefix_limit=prefix_limit.astype(np.int32), merge_tokens=merges.merge_tokens.astype(np.int32),
        merge_offsets=merges.merge_offsets.astype(np.int32), merge_slots=merges.merge_slots.astype(np.int32),
        num_tokens=step.num_tokens, num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size,
        tile=tile)
