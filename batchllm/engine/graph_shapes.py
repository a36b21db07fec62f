"""The shapes of the CUDA graphs and how a step fills their static buffers, in one place: token
buckets, the static token buffer's layout, padding rows, and the padded attention plan of the
decode graphs (docs/design.md, "CUDA graphs")."""

from __future__ import annotations

import numpy as np
import torch

from batchllm.attention_plan.work_list import PrefixSharedPlan
from batchllm.engine.step_inputs import StepInputs
from batchllm.ops.transfer import PinnedStaging, Staged

# Rows of the decode graphs (every chunk one row), each with at least one spare row: every 64 rows
# from 128 to 512 and every 128 to 2048, since padding rows add to the GEMMs of a decode step of a
# few hundred rows, which are compute-bound. The decode steps of uniform 1000/1000, 1000/2000,
# 128/2048 and 2048/2048 on the H200's KV cache (880, 585, 808 and 429 rows) ran 1.15-1.31x their
# rows on power-of-two-like buckets, 1.03-1.11x on these (the batchllm policy's schedules on the host);
# end to end, 1000/1000 on the H200 ran 1.6% faster in one pair of runs, within their run-to-run
# spread (BENCHMARKS.md).
DECODE_ROWS_BUCKETS = (8, 16, 32, 64, 128, 192, 256, 320, 384, 448, 512, *range(640, 2049, 128))
MIN_BLOCK_TABLE_WIDTH = 16
# Piecewise graphs: powers of two up to this many tokens, then its multiples.
PIECEWISE_STEP_TOKENS = 256


def decode_rows_bucket(num_tokens: int) -> int | None:
    """Rows of the decode graph a decode step of num_tokens rows runs in (None: too many)."""
    return next((b for b in DECODE_ROWS_BUCKETS if num_tokens < b), None)


def block_table_width(num_blocks: int) -> int:
    """Block-table columns of a decode graph for a step whose longest table has num_blocks: a power
    of two, at least MIN_BLOCK_TABLE_WIDTH."""
    return max(1 << max(num_blocks - 1, 0).bit_length(), MIN_BLOCK_TABLE_WIDTH)


def graph_items_capacity(num_rows: int) -> int:
    """Work items a decode graph of num_rows rows holds per list: tiles x KV pieces, see
    attention_plan/work_list.py."""
    return 4 * num_rows + 1024


def graph_slots_capacity(num_rows: int) -> int:
    """Partial results a decode graph of num_rows rows merges."""
    return 8 * num_rows + 1024


def piecewise_buckets(max_num_tokens: int) -> tuple[int, ...]:
    """Token counts the piecewise graphs are captured for: powers of two from 8 up to 256, where a
    step's GEMMs read the weights in about the same time whatever its rows, so padding costs
    little; then multiples of 256, since a GEMM computes whole tiles of 128 or 256 rows anyway;
    and max_num_tokens itself, the size of a full step."""
    buckets = {b for b in (8, 16, 32, 64, 128, 256) if b < max_num_tokens}
    buckets.update(range(2 * PIECEWISE_STEP_TOKENS, max_num_tokens, PIECEWISE_STEP_TOKENS))
    buckets.add(max_num_tokens)
    return tuple(sorted(buckets))


def bucket_for(num_tokens: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket of at least num_tokens rows (None: none is that large)."""
    return next((b for b in buckets if num_tokens <= b), None)


def token_stride(num_rows: int) -> int:
    """Entries between the static token buffer's arrays for num_rows rows: num_rows rounded up to
    16 bytes (Triton specialises pointer arguments on 16-byte alignment)."""
    return -(-num_rows // 2) * 2


def token_views(buffer: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, positions, slot_mapping) of num_rows rows: views of the flat int64 token buffer,
    laid out one after another (a step's three arrays travel in one copy). A graph captures the
    views of its rows; each step of that many rows fills the same ones."""
    stride = token_stride(num_rows)
    return buffer[:num_rows], buffer[stride:stride + num_rows], buffer[2 * stride:2 * stride + num_rows]


def stage_tokens(staging: PinnedStaging, inputs: StepInputs, num_rows: int) -> Staged:
    """The step's input ids, positions and slots for the first 3 * token_stride(num_rows) entries of
    the token buffer, padded to num_rows rows: padding rows read id 0 at position 0 and store no
    KV (slot -1); their outputs are never sampled."""
    num_tokens, stride = inputs.num_tokens, token_stride(num_rows)
    if num_tokens > num_rows:
        raise ValueError(f"a step of {num_tokens} tokens does not fit {num_rows} rows")
    staged = staging.stage((3, stride), np.int64)
    ids, positions, slots = staged.array
    ids[:num_tokens] = inputs.input_ids
    positions[:num_tokens] = inputs.positions
    slots[:num_tokens] = inputs.slot_mapping
    ids[num_tokens:] = 0
    positions[num_tokens:] = 0
    slots[num_tokens:] = -1
    return staged


def decode_plan_fits(plan: PrefixSharedPlan, lists: tuple[np.ndarray, np.ndarray], num_rows: int,
                     num_blocks: int) -> bool:
    """Whether a decode step's plan fits the static plan of a graph of num_rows rows and num_blocks
    block-table columns (lists: plan.class_lists())."""
    return (max(items.shape[0] for items in lists) <= graph_items_capacity(num_rows)
            and plan.num_partial_slots <= graph_slots_capacity(num_rows)
            and plan.merge_tokens.shape[0] < num_rows
            and plan.block_tables.shape[1] <= num_blocks
            and plan.dense.shape[0] == 0)  # dense calls are host-launched per step (none in decode plans)


def fill_decode_plan(host: dict[str, np.ndarray], plan: PrefixSharedPlan, lists: tuple[np.ndarray, np.ndarray],
                     num_rows: int, num_tokens: int) -> None:
    """Write a decode step's plan into a graph's static plan arrays (host: attention_plan.layout's
    views of graph_layout), padded: item counts on the device (the persistent launches run only
    the real items), zero block tables and prefix limits past the step's, padded merges that
    write the spare last row, and the KV positions of the plan's lead rows (XQA's: every row of an
    XQA graph's step), 1 past them (a padded row reads position 0 of block 0)."""
    host["num_items"][:] = plan.item_counts(lists)
    for name, items in (("work", lists[0]), ("work_small", lists[1])):
        host[name][:items.shape[0]] = items  # (the persistent launch never reads past num_items)
    tables = host["block_tables"]
    tables[:] = 0
    tables[:plan.block_tables.shape[0], :plan.block_tables.shape[1]] = plan.block_tables
    host["prefix_limit"][:] = 0
    host["prefix_limit"][:num_tokens] = plan.prefix_limit
    num_merge = plan.merge_tokens.shape[0]
    host["merge_tokens"][:] = num_rows - 1  # the spare row absorbs the padded merges
    host["merge_tokens"][:num_merge] = plan.merge_tokens
    host["merge_offsets"][:] = plan.num_partial_slots
    host["merge_offsets"][:num_merge + 1] = plan.merge_offsets
    host["merge_slots"][:] = 0
    host["merge_slots"][:plan.num_partial_slots] = plan.merge_slots
    host["seq_lens"][:] = 1
    host["seq_lens"][:plan.lead_seq_lens.shape[0]] = plan.lead_seq_lens
