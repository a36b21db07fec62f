"""Dense calls of a step's attention plan (docs/design.md, "Dense calls"): the blocks of KV that
every row of a segment sees, and the causal squares of prefill chunks, which a library kernel
(ops/dense_attention.py) runs faster than the work list's tiles. Host side, numpy; on the
device they are ops/plan_device.py's DenseCalls."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from batchllm.attention_plan.segments import (KIND_PREFIX, MASK_CAUSAL, MASK_ROW_LIMIT, Columns, Groups, Segments,
                                              Step, flat_ranges)
from batchllm.attention_plan.tile_config import TileConfig

DENSE_FIELDS = 9  # columns of a plan's dense calls (PrefixSharedPlan.dense)


def dense_size_step(num: np.ndarray) -> np.ndarray:
    """The spacing of the dense calls' sizes around each of num (> 0): an eighth of its octave's
    top (2^(bit_length - 3)), so that sizes from 512 to 1024 step by 128.

    The library kernel (cuDNN through PyTorch) builds an execution plan for every shape it has not
    seen, about 65 ms of host time on the H200 against 0.1-0.3 ms for a call it has seen; prompt
    lengths and chunk sizes would give nearly every call a new shape (119 shapes in 139 calls of a
    shared-prefix batch). Rows padded up and unmasked KV cut down to these sizes bound the shapes
    at four an octave each, for at most 25% more rows (12% on average), while the KV cut off
    stays in the work list."""
    num = np.asarray(num, dtype=np.int64)
    return np.left_shift(1, np.maximum(np.frexp(np.maximum(num, 1))[1] - 3, 0)).astype(np.int64)


def dense_rows_padded(num_rows: int) -> int:
    """num_rows rounded up to the dense calls' sizes (dense_size_step)."""
    step = int(dense_size_step(np.array([num_rows]))[0])
    return -(-num_rows // step) * step


def square_seqs(step: Step, tile: TileConfig, block_size: int) -> np.ndarray:
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
    rows, starts = step.num_rows[s], step.query_start_loc[s]
    offsets = (step.first_positions[s] - own_start[s]) % block_size
    joins = (rows[1:] == rows[:-1]) & (offsets[1:] == offsets[:-1]) & (starts[1:] == starts[:-1] + rows[:-1])
    run = np.cumsum(np.concatenate([[True], ~joins])) - 1
    chosen[s[np.bincount(run, weights=rows)[run] >= min_rows]] = True
    return chosen


def carved_seqs(step: Step, groups: Groups, tile: TileConfig, squares: np.ndarray) -> np.ndarray:
    """[num_seqs] bool: the group prefix chunks that leave their group's segment (carve_prefix_chunks).

    A prefix chunk's first rows see only the context before it, so while it shares its group's
    segment the members' rows in the same step, which all see the whole prefix, get no unmasked
    call (the segment's call stops at its least row limit). A chunk leaves when it is a causal
    square, and, with dense calls on, when its group has at least tile.dense_min_rows members' rows
    in the step: a step of 8192 tokens of 2000-token prefixes, each with 16 members of 200 distinct
    tokens, then runs 3.4 of its 5.8 TFLOP of tile attention as one cuDNN call."""
    chunks = (step.group_ids >= 0) & step.is_prefix & (step.num_rows > 0)
    if tile.dense_min_rows <= 0 or not chunks.any():
        return chunks & squares
    grouped = groups.grouped_seqs
    member_rows = np.bincount(groups.group_of_seq, weights=np.where(step.is_prefix[grouped], 0, step.num_rows[grouped]))
    enough = np.zeros(step.num_seqs, bool)
    enough[grouped] = member_rows[groups.group_of_seq] >= tile.dense_min_rows
    return chunks & (squares | enough)


def carve_prefix_chunks(seg: Segments, step: Step, carved: np.ndarray) -> Segments:
    """The prefix chunks of `carved` (carved_seqs) leave their group's segment.

    A group's prefix chunk shares its group's segment with the members' rows, and its rows'
    limits make it causal over the chunk's own positions. Carved, such a chunk becomes a causal
    segment of its own over its seq's KV (a causal call for its square, cut_dense_calls), and the
    members' rows before and after it stay one row-limit segment each, which then sees the whole
    prefix: an unmasked call over it if they are enough rows."""
    chunks = np.nonzero(carved)[0]
    for s in chunks.tolist():
        begin, end = int(step.query_start_loc[s]), int(step.query_start_loc[s + 1])
        seg_end = seg.q_start + seg.num_rows
        j = int(np.nonzero((seg.mask_mode == MASK_ROW_LIMIT) & (seg.q_start <= begin) & (seg_end >= end))[0][0])
        before, after = seg.take([j]), seg.take([j])
        before.num_rows = np.array([begin - seg.q_start[j]])
        after.q_start, after.num_rows = np.array([end]), np.array([seg_end[j] - end])
        one = np.ones(1, np.int64)
        chunk = Segments(one * begin, one * (end - begin), one * s, one * 0, one * step.seq_lens[s], one * 0, one * 0,
                         one * MASK_CAUSAL, one * step.first_positions[s], one * KIND_PREFIX)
        rest = seg.take(np.arange(seg.q_start.shape[0]) != j)
        seg = Segments.concat([rest] + [part for part in (before, chunk, after) if part.num_rows[0] > 0])
    return seg


@dataclass
class Dense(Columns):
    """Dense calls before partial slots: per call its rows and KV range (see cut_dense_calls)."""

    q_start: np.ndarray
    num_rows: np.ndarray
    seq: np.ndarray
    first_block: np.ndarray
    offset: np.ndarray
    kv_len: np.ndarray
    causal: np.ndarray


def _dense_range(seg: Segments, rows: np.ndarray, kv_start: np.ndarray, kv_len: np.ndarray, causal: int,
                 block_size: int) -> Dense:
    rel = kv_start - seg.base_pos[rows]
    return Dense(seg.q_start[rows], seg.num_rows[rows], seg.seq[rows], seg.base_block[rows] + rel // block_size,
                 rel % block_size, kv_len, np.full(rows.shape[0], causal, np.int64))


def cut_dense_calls(seg: Segments, prefix_limit: np.ndarray, tile: TileConfig, block_size: int,
                    squares: np.ndarray) -> tuple[Segments, Dense]:
    """Dense calls: the KV that every row of a segment sees, cut off the segment's front, and
    the causal square of a long prefill chunk's own positions.

    A prefill chunk's rows all see their group's prefix up to the least row limit (members: the
    whole prefix), or their own context before the chunk (causal: up to the first row's
    position). That block is plain dense attention, rows x KV with no mask: a library kernel
    runs it on the gathered blocks faster than the BIG tiles (tile_config.py), and its output
    and log-sum-exp join the row's other parts in the merge. Segments of at least
    tile.dense_min_rows rows whose block holds at least tile.dense_min_tokens positions get one,
    over the block's first positions cut down to the dense calls' sizes (dense_size_step; the
    whole block with tile.dense_any_size).
    The own segment of a seq in `squares` (square_seqs) also gets a causal call over the chunk's
    own positions (row i sees the first i + 1), which the library kernel runs with its causal
    mask; with tile.dense_causal_whole, over its whole segment instead, context and own positions
    (row i of r sees the first kv_len - r + i + 1: a bottom-right mask), and no unmasked call.
    The rest of each segment stays in the work list. Returns (segments, calls: the unmasked
    ones, then the causal ones, each in row order)."""
    none = Dense(*(np.zeros(0, np.int64) for _ in fields(Dense)))
    if tile.dense_min_rows <= 0 or seg.q_start.size == 0:
        return seg, none
    causal = seg.mask_mode == MASK_CAUSAL
    square = np.nonzero(causal & squares[seg.seq] & (seg.first_position >= seg.kv_start)
                        & (seg.kv_end == seg.first_position + seg.num_rows))[0]
    visible = np.where(causal, seg.first_position + 1, seg.kv_end)
    # the context only: the square is a call of its own (with dense_causal_whole, which holds the context too)
    visible[square] = seg.kv_start[square] if tile.dense_causal_whole else seg.first_position[square]
    limited = np.nonzero((seg.mask_mode == MASK_ROW_LIMIT) & (seg.num_rows > 0))[0]
    if limited.size:
        rows = flat_ranges(seg.q_start[limited], seg.num_rows[limited])
        visible[limited] = np.minimum.reduceat(prefix_limit[rows], np.cumsum(seg.num_rows[limited])
                                               - seg.num_rows[limited])
    dense_end = np.minimum(seg.kv_end, visible)
    length = np.maximum(dense_end - seg.kv_start, 0)
    step = np.ones_like(length) if tile.dense_any_size else dense_size_step(length)
    dense_end = seg.kv_start + length // step * step
    chosen = np.nonzero((seg.num_rows >= tile.dense_min_rows)
                        & (dense_end - seg.kv_start >= tile.dense_min_tokens))[0]
    if chosen.size == 0 and square.size == 0:
        return seg, none
    causal_start = seg.kv_start[square] if tile.dense_causal_whole else seg.first_position[square]
    calls = Dense.concat([
        _dense_range(seg, chosen, seg.kv_start[chosen], dense_end[chosen] - seg.kv_start[chosen], 0, block_size),
        _dense_range(seg, square, causal_start, seg.kv_end[square] - causal_start, 1, block_size)])
    seg.kv_start = seg.kv_start.copy()
    seg.kv_start[chosen] = dense_end[chosen]
    seg.kv_end = seg.kv_end.copy()
    seg.kv_end[square] = causal_start
    return seg, calls.take(np.lexsort((calls.q_start, calls.causal)))


def batch_squares(dense: np.ndarray) -> np.ndarray:
    """[num_calls] the `batch` column: consecutive causal calls of equal length and block offset
    on consecutive rows whose partial slots follow one another (or that have none) run as one
    call of the library kernel with a batch dimension, which costs the host what one call
    costs. At a batch's first call: the number of calls it holds; 0 at the others."""
    batch = np.ones(dense.shape[0], np.int64)
    first = 0
    for index in range(1, dense.shape[0]):
        q_start, q_count, _, _, offset, kv_len, base, causal = dense[index, :8].tolist()
        before = dense[index - 1]
        joins = (causal and before[7] and kv_len == before[5] and q_count == before[1] and offset == before[4]
                 and q_start == before[0] + before[1]
                 and (base == before[6] == -1 or (base >= 0 and before[6] >= 0 and base == before[6] + before[1])))
        if joins:
            batch[first] += 1
            batch[index] = 0
        else:
            first = index
    return batch
