"""The device side of an attention plan (the host side is batchllm/attention_plan/): the plan's
arrays in one device buffer, its dense calls' block tensors, and the SM count that the planner
sizes split-KV pieces by."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from batchllm.attention_plan.layout import PLAN_ARRAYS, step_layout
from batchllm.attention_plan.segments import ceil_div
from batchllm.attention_plan.tile_config import TileConfig
from batchllm.attention_plan.work_list import PrefixSharedPlan, num_unpacked_items
from batchllm.ops.transfer import Upload, to_device


def device_num_sms(device: torch.device | str, cpu_num_sms: int = 8) -> int:
    """Streaming multiprocessors of a CUDA device: split-KV pieces are sized so that the launch
    fills them. `cpu_num_sms` stands in where there is no GPU (the Triton interpreter runs the
    programs one after another, so a few pieces per range are enough there)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return cpu_num_sms


@dataclass(frozen=True)
class DenseCall:
    """One dense call of a plan on the device (attention_plan.dense_calls.cut_dense_calls): rows
    [q_start, q_start + q_count) x the kv_len positions that start `offset` into the cache blocks
    `blocks` (a view of the plan's block tables); its rows' outputs go to partial slots from
    partial_base (-1: to the output itself). causal: row i of the call's r rows sees the first
    kv_len - r + i + 1 positions (a square: kv_len == r). A batch of `batch` causal squares: rows
    [q_start, q_start + q_count) are batch squares of kv_len rows each, whose blocks (each its own
    `offset`-shifted run of blocks) follow one another in `blocks`."""

    q_start: int
    q_count: int
    blocks: torch.Tensor
    offset: int
    kv_len: int
    partial_base: int
    causal: bool = False
    batch: int = 1


class DenseCallRunner(Protocol):
    """A step's dense calls on a kernel of their own (ops/fa3_dense.py), in place of the library
    kernel that ops/prefix_attention.run_dense_calls calls: writes each call's rows to the output
    or to their partial slots with base-2 log-sum-exps."""

    def __call__(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                 part_out: torch.Tensor, part_lse: torch.Tensor, scale: float, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> None: ...


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
    # num_items[0] of `work_big` and num_items[1] of `work_small`, of which a packed launch runs the
    # first num_items[2] one to a program. 0: one program per item.
    num_items: torch.Tensor | None = None  # [3] int32 on the device (PrefixSharedPlan.item_counts)
    persistent_programs: int = 0
    # tile.split_classes: the BIG and the SMALL items of `work`, each in work order
    work_big: torch.Tensor | None = None
    work_small: torch.Tensor | None = None
    # the plan's dense calls, launched from the host (their blocks cut once per step)
    dense: tuple[DenseCall, ...] = ()
    # [num_lead_rows] int32: the KV positions (>= 1) of the first rows, which XQA attends
    # (ops/xqa_decode.py) and the work list leaves out (PrefixSharedPlan.lead_seq_lens): some of a
    # step's, or every row of an XQA decode graph (its padding rows 1); None: none
    lead_seq_lens: torch.Tensor | None = None
    # runs `dense` in place of the library kernel (prepared once per step), or None
    dense_runner: DenseCallRunner | None = None
    # the items of work_small that a packed SMALL launch runs one to a program, the first ones
    # (work_list.num_unpacked_items; a persistent launch reads them from num_items[2])
    num_unpacked_small: int = 0


def plan_to_device(plan: PrefixSharedPlan, device: torch.device | str,
                   upload: Upload | None = None) -> PrefixSharedPlanOnDevice:
    """One host-to-device copy of every array of a step's plan (laid out by layout.step_layout);
    done once per step, used by every layer. upload: how the buffer travels (the runner's
    PinnedStaging.upload); None: a one-off pinned copy."""
    arrays = {name: np.asarray(getattr(plan, name), dtype=np.int32) for name in PLAN_ARRAYS}
    num_unpacked_small = 0
    if plan.tile.split_classes:
        arrays["work_big"], arrays["work_small"] = plan.class_lists()
        num_unpacked_small = num_unpacked_items(arrays["work_small"], plan.tile)
    if plan.lead_seq_lens.size:
        arrays["lead_seq_lens"] = plan.lead_seq_lens
    layout = step_layout(arrays)
    packed = layout.pack(arrays)
    buffer = upload({"plan": packed})["plan"] if upload is not None else to_device(packed, torch.device(device))
    views = layout.views(buffer)
    lead_seq_lens = views.pop("lead_seq_lens", None)
    return PrefixSharedPlanOnDevice(
        **views, lead_seq_lens=lead_seq_lens, num_partial_slots=plan.num_partial_slots, num_tokens=plan.num_tokens,
        num_heads=plan.num_heads, num_kv_heads=plan.num_kv_heads, block_size=plan.block_size, tile=plan.tile,
        dense=dense_calls_on(plan.dense, views["block_tables"], plan.block_size),
        num_unpacked_small=num_unpacked_small)


def dense_calls_on(dense: np.ndarray, block_tables: torch.Tensor, block_size: int) -> tuple[DenseCall, ...]:
    """A plan's dense calls (its `dense` array) on the device, their blocks cut from the device
    block tables, each batch of causal calls as one call."""
    calls, rows = [], dense.tolist()
    for index, (q_start, _, _, _, offset, kv_len, partial_base, causal, batch) in enumerate(rows):
        if batch == 0:
            continue  # in the batch of an earlier call
        num_blocks = ceil_div(offset + kv_len, block_size)
        runs = [block_tables[seq, first:first + num_blocks] for _, _, seq, first, *_ in rows[index:index + batch]]
        calls.append(DenseCall(q_start, sum(row[1] for row in rows[index:index + batch]),
                               runs[0] if batch == 1 else torch.cat(runs), offset, kv_len, partial_base,
                               bool(causal), batch))
    return tuple(calls)
