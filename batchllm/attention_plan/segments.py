"""Host side of a step's attention plan, before tiling: the step's metadata as numpy arrays, its
prefix-sharing groups, and its segments (rows x a KV range each: a group's rows x its prefix,
a seq's rows x its own KV). Built once per step (work_list.py, dense_calls.py)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from batchllm.attention_plan.checks import check

MASK_NONE, MASK_CAUSAL, MASK_ROW_LIMIT = 0, 1, 2
KIND_PREFIX, KIND_DISTINCT = 0, 1


def as_numpy(x, dtype) -> np.ndarray:
    """A numpy array of x: a sequence, a numpy array, or a tensor (on any device; copied to the
    host), recognised by its methods so that the planner never imports torch."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        x = x.detach().cpu().numpy()
    return np.asarray(x).astype(dtype, copy=False)


def flat_ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of arange(start, start + count) for each pair: [sum(counts)] int64."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + (np.arange(total) - offsets)


def index_within(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each of `counts[i]` copies of i: (parent i, index 0..counts[i]-1 within it)."""
    parent = np.repeat(np.arange(counts.shape[0]), counts)
    return parent, np.arange(parent.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts)


def ceil_div(a, b):
    return -(-a // b)


class Columns:
    """Equal-length numpy columns (a dataclass's fields); `take` selects rows of all of them,
    `concat` joins several column sets of one class as int64."""

    def take(self, rows):
        return type(self)(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})

    @classmethod
    def concat(cls, parts: list):
        return cls(**{f.name: np.concatenate([getattr(p, f.name) for p in parts]).astype(np.int64)
                      for f in fields(cls)})


@dataclass
class Step:
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


def step_arrays(query_start_loc, seq_lens, shared_kv_lens, block_tables, group_ids, is_prefix) -> Step:
    qsl, lens = as_numpy(query_start_loc, np.int64), as_numpy(seq_lens, np.int64)
    num_seqs = lens.shape[0]
    check(qsl.shape == (num_seqs + 1,), f"query_start_loc must be [num_seqs + 1], got {qsl.shape}")
    num_rows = qsl[1:] - qsl[:-1]
    step = Step(
        qsl, lens, as_numpy(shared_kv_lens, np.int64), as_numpy(block_tables, np.int32),
        np.full(num_seqs, -1, np.int64) if group_ids is None else as_numpy(group_ids, np.int64),
        np.zeros(num_seqs, bool) if is_prefix is None else as_numpy(is_prefix, bool),
        num_rows, lens - num_rows, num_seqs, int(qsl[-1]) if num_seqs else 0)
    check(step.shared_kv_lens.shape == step.group_ids.shape == step.is_prefix.shape == (num_seqs,),
          "per-seq arrays differ in length")
    check(step.block_tables.ndim == 2 and step.block_tables.shape[0] == num_seqs,
          f"block_tables must be [num_seqs, max_blocks], got {step.block_tables.shape}")
    check(bool(np.all(num_rows >= 0)) and bool(np.all(lens >= num_rows)), "need 0 <= q_len <= seq_len per seq")
    return step


@dataclass
class Groups:
    """The step's prefix-sharing groups (rows are laid out group by group)."""

    grouped_seqs: np.ndarray  # seqs that belong to a group
    group_of_seq: np.ndarray  # [len(grouped_seqs)] group index of each
    prefix_len: np.ndarray  # [num_groups] shared prefix KV positions P_g
    representative_seq: np.ndarray  # [num_groups] the seq whose block table holds the prefix
    row_begin: np.ndarray  # [num_groups] first query row of the group
    row_end: np.ndarray  # [num_groups] one past its last row


def step_groups(step: Step) -> Groups:
    grouped = np.nonzero(step.group_ids >= 0)[0]
    group_of = np.unique(step.group_ids[grouped], return_inverse=True)[1].reshape(-1)
    num_groups = int(group_of.max()) + 1 if group_of.size else 0
    prefix_len = np.zeros(num_groups, np.int64)
    np.maximum.at(prefix_len, group_of,
                  np.where(step.is_prefix[grouped], step.seq_lens[grouped], step.shared_kv_lens[grouped]))
    representative = np.full(num_groups, step.num_seqs, np.int64)
    np.minimum.at(representative, group_of, grouped)
    last_seq = np.full(num_groups, -1, np.int64)
    np.maximum.at(last_seq, group_of, grouped)
    # A group's prefix segment spans its rows from first to last: another seq's rows in between
    # would see this group's prefix.
    split = np.nonzero(last_seq - representative + 1 != np.bincount(group_of, minlength=num_groups))[0]
    if split.size:
        raise ValueError(f"a group's seqs must be consecutive in the step; group id "
                         f"{int(step.group_ids[representative[split[0]]])} has other seqs between its seqs")
    row_begin = np.full(num_groups, step.num_tokens, np.int64)
    row_end = np.zeros(num_groups, np.int64)
    np.minimum.at(row_begin, group_of, step.query_start_loc[grouped])
    np.maximum.at(row_end, group_of, step.query_start_loc[grouped + 1])
    return Groups(grouped, group_of, prefix_len, representative, row_begin, row_end)


def row_prefix_limits(step: Step, groups: Groups) -> np.ndarray:
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
class Segments(Columns):
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


def step_segments(step: Step, groups: Groups, block_size: int) -> Segments:
    """Prefix segments (a group's rows x its prefix, row limits) and distinct segments (a seq's
    rows x its own KV, causal; ungrouped seqs that still read shared blocks also x [0, shared))."""
    g = np.nonzero((groups.prefix_len > 0) & (groups.row_end > groups.row_begin))[0]
    zeros = np.zeros(g.shape[0], np.int64)
    prefix = Segments(groups.row_begin[g], groups.row_end[g] - groups.row_begin[g], groups.representative_seq[g],
                      zeros, groups.prefix_len[g], zeros, zeros, zeros + MASK_ROW_LIMIT, zeros,
                      zeros + KIND_PREFIX)
    qsl, lens, shared, num_rows = step.query_start_loc, step.seq_lens, step.shared_kv_lens, step.num_rows
    active, in_group = num_rows > 0, step.group_ids >= 0
    s = np.nonzero(active & ~(in_group & step.is_prefix) & (lens > shared))[0]  # own KV [shared, seq_len)
    own = Segments(qsl[s], num_rows[s], s, shared[s], lens[s], ceil_div(shared[s], block_size), shared[s],
                   np.full_like(s, MASK_CAUSAL), step.first_positions[s], np.full_like(s, KIND_DISTINCT))
    s = np.nonzero(active & ~in_group & (shared > 0))[0]  # [0, shared) of ungrouped seqs
    zeros = np.zeros(s.shape[0], np.int64)
    shared_part = Segments(qsl[s], num_rows[s], s, zeros, np.minimum(shared[s], lens[s]), zeros, zeros,
                           np.full_like(s, MASK_CAUSAL), step.first_positions[s], np.full_like(s, KIND_DISTINCT))
    return Segments.concat([prefix, own, shared_part])
