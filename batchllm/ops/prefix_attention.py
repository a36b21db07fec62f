"""Horizontally fused prefix-shared attention over a paged KV cache (BatchLLM section 5).

`prefix_shared_attention` runs ONE launch of heterogeneous work (prefix MatMul tiles of every
group + distinct tiles of every request, see attention_plan/work_list.py). Rows that get several partial
results are merged by a tiny second merge kernel. The cache is in the query dtype, or
float8_e4m3fn with its scales (dequantized in the kernel's registers, attention_kernels.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from batchllm.attention_plan.checks import check, next_power_of_2
from batchllm.attention_plan.dense_calls import dense_rows_padded
from batchllm.attention_plan.work_list import WORK_FIELDS
from batchllm.ops.attention_kernels import merge_partials_kernel, work_list_attention_kernel
from batchllm.ops.dense_attention import dense_attention_lse
from batchllm.ops.dense_store import LOG2_E, store_dense_output
from batchllm.ops.kv_gather import gather_dense_kv
from batchllm.ops.kv_quant import check_kv_scales, is_fp8
from batchllm.ops.occupancy import kernel_programs_per_sm
from batchllm.ops.plan_device import PrefixSharedPlanOnDevice, device_num_sms


def _validate(query, k_cache, v_cache, plan: PrefixSharedPlanOnDevice, k_scale: float = 1.0,
              v_scale: float = 1.0) -> None:
    check(isinstance(plan, PrefixSharedPlanOnDevice), "plan must be a PrefixSharedPlan on the device (ops.plan_device.plan_to_device)")
    check(query.dim() == 3, f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}")
    check(k_cache.dim() == 4 and v_cache.shape == k_cache.shape,
          f"caches must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    num_tokens, num_heads, head_dim = query.shape
    check(num_tokens == plan.num_tokens, f"query has {num_tokens} rows, the plan {plan.num_tokens}")
    check(num_heads == plan.num_heads and k_cache.shape[2] == plan.num_kv_heads,
          f"heads {num_heads}/{k_cache.shape[2]} differ from the plan's {plan.num_heads}/{plan.num_kv_heads}")
    check(k_cache.shape[1] == plan.block_size, f"cache block size {k_cache.shape[1]} != plan's {plan.block_size}")
    check(k_cache.shape[3] == head_dim, f"cache head_dim {k_cache.shape[3]} != query's {head_dim}")
    check(head_dim in (16, 32, 64, 128, 256), f"head_dim must be a power of 2 in [16, 256], got {head_dim}")
    check(query.dtype in (torch.float16, torch.bfloat16, torch.float32), f"unsupported dtype {query.dtype}")
    check(k_cache.dtype == v_cache.dtype, f"k_cache/v_cache dtypes differ: {k_cache.dtype} / {v_cache.dtype}")
    check(k_cache.dtype == query.dtype or is_fp8(k_cache.dtype),
          f"query/cache dtypes differ: {query.dtype} / {k_cache.dtype} (a cache is in the query dtype or "
          "float8_e4m3fn)")
    check_kv_scales(k_scale, v_scale, k_cache.dtype)
    tile = plan.tile
    check(tile.small_pack == 1 or tile.small_m // (num_heads // plan.num_kv_heads) >= tile.small_pack,
          f"small_pack {tile.small_pack} needs small_m {tile.small_m} to hold that many items' "
          f"{num_heads // plan.num_kv_heads} query heads")
    check(query.stride(-1) == 1 and k_cache.stride(-1) == 1, "query and caches must be contiguous in head_dim")
    check(k_cache.stride() == v_cache.stride(), "k_cache and v_cache must share strides")
    check(query.device == k_cache.device == plan.work.device, "query, caches and plan must be on one device")


def small_pack(plan, classes: int, window: int | None, persistent: bool) -> int:
    """Items to a program of a launch: tile.small_pack for a launch of SMALL items only (whose
    items the plan made one row each, unmasked) without a sliding window, else 1. A launch that is
    not persistent (an eager step's) packs only when none of its items is long: with some, its
    long items run one to a program in the packed kernel, whose variant of that path ran the
    decode rows of a 2048/128 step 4% slower than the plain kernel on the H200."""
    if classes != 1 or window or (not persistent and plan.num_unpacked_small):
        return 1
    return plan.tile.small_pack


def launch_arguments(work, query, k_cache, v_cache, plan, out, part_out, part_lse, scale, classes: int = 0,
                     num_items=None, window: int | None = None, positions=None, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> tuple[tuple, dict]:
    """(arguments, constexprs and compile options) of work_list_attention_kernel for one launch
    over `work` (see _launch_items)."""
    tile = plan.tile
    num_warps, num_stages, max_registers = tile.num_warps, tile.num_stages, None
    small, big = (tile.small_m, tile.small_n), (tile.big_m, tile.big_n)
    # a class-specialised variant compiles one tile class: the other's sizes are set to its own,
    # so that they make no variants of their own
    if classes == 1:
        num_warps = tile.small_num_warps or num_warps
        num_stages = tile.small_num_stages or num_stages
        max_registers, big = tile.small_max_registers, small
    elif classes == 2:
        small = big
    persistent = num_items is not None
    kv_fp8 = is_fp8(k_cache.dtype)
    args = (
        # without a persistent launch the item-count pointer is never read
        work, num_items if persistent else work, work.shape[0],
        query, out, part_out, part_lse, k_cache, v_cache, plan.block_tables, plan.prefix_limit,
        positions if window else plan.prefix_limit,  # without a window the positions are never read
        float(scale) * float(k_scale) * LOG2_E, float(v_scale), window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), plan.block_tables.stride(0))
    constants = dict(
        NUM_KV_HEADS=plan.num_kv_heads, NUM_HEADS=plan.num_heads, HEAD_DIM=query.shape[2],
        PAGE=plan.block_size, WORK_FIELDS=WORK_FIELDS, SMALL_M=small[0], SMALL_N=small[1], BIG_M=big[0],
        BIG_N=big[1], DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32", CLASSES=classes,
        SMALL_PACK=small_pack(plan, classes, window, persistent),
        PERSISTENT=persistent, KV_FP8=kv_fp8, FP8_AS_F16=kv_fp8 and tile.fp8_conversion != "query",
        FP8_PTX=kv_fp8 and tile.fp8_conversion == "float16_ptx_v" and query.is_cuda,  # (the interpreter runs no PTX)
        WINDOWED=bool(window), num_warps=num_warps, num_stages=num_stages, maxnreg=max_registers,
    )
    return args, constants


def _launch_items(work, query, k_cache, v_cache, plan, out, part_out, part_lse, scale,
                  classes: int = 0, num_items=None, window: int | None = None, positions=None,
                  k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """One launch over `work`. classes: 0 both tile classes, 1 SMALL items only, 2 BIG only.
    num_items: [1] int32 device count of the items of `work` to run (a packed SMALL launch: [2], and
    how many of the first ones run one to a program), by a persistent launch of
    plan.persistent_programs programs (CUDA graphs), fewer where an SM holds fewer of them at once
    (the rest would run as a second wave); None: one program per item of `work`.
    k_scale / v_scale: a float8_e4m3fn cache's scales (K's folds into the softmax scale)."""
    persistent = num_items is not None
    if not persistent and work.shape[0] == 0:
        return
    args, constants = launch_arguments(work, query, k_cache, v_cache, plan, out, part_out, part_lse, scale, classes,
                                       num_items, window, positions, k_scale, v_scale)
    num_programs = -(-work.shape[0] // constants["SMALL_PACK"]) * plan.num_kv_heads
    grid = (plan.persistent_programs if persistent else num_programs,)
    if persistent and query.is_cuda:
        compiled = work_list_attention_kernel.warmup(*args, grid=grid, **constants)
        grid = (min(grid[0], device_num_sms(query.device) * kernel_programs_per_sm(compiled, query.device)),)
    work_list_attention_kernel[grid](*args, **constants)


def _work_lists(plan) -> list[tuple]:
    """(work, classes, num_items) of each launch of `plan` (see _launch_items)."""
    persistent = plan.persistent_programs > 0 and plan.num_items is not None
    if plan.tile.split_classes and plan.work_big is not None:  # two class-specialised launches
        if persistent:  # num_items holds [BIG count, SMALL count, SMALL items not packed]
            return [(plan.work_big, 2, plan.num_items[0:1]), (plan.work_small, 1, plan.num_items[1:3])]
        return [(plan.work_big, 2, None), (plan.work_small, 1, None)]
    return [(plan.work, 0, plan.num_items[0:1] if persistent else None)]


def _dense_output(call, query, k_cache, v_cache, scale, k_scale: float = 1.0):
    """One dense call (attention_plan.dense_calls.cut_dense_calls): gather its blocks and attend on the library
    kernel (with its causal mask for a chunk's own positions; a batch of equal squares in one
    call). Returns (out [batch, rows, heads, head_dim] before an FP8 cache's V scale, lse [batch,
    rows, heads] natural log): store_dense_output writes them to their rows.

    The library kernel sees its rows padded up to the dense calls' sizes (dense_rows_padded), so
    that it meets few shapes: the extra rows are the query's next rows where it has them (else
    zeros), a causal square's with zero KV positions after its own, which its mask hides from the
    real rows; their outputs are dropped."""
    num_rows = call.q_count // call.batch
    padded = dense_rows_padded(num_rows)
    # an FP8 cache's blocks in the query dtype (exact; the scales fold into scale and the output)
    key, value = gather_dense_kv(k_cache, v_cache, call.blocks, call.batch, call.offset, call.kv_len,
                                 padded if call.causal else call.kv_len, query.dtype)
    if call.batch == 1 and call.q_start + padded <= query.shape[0]:
        rows = query[call.q_start:call.q_start + padded].unsqueeze(0)
    else:
        rows = query[call.q_start:call.q_start + call.q_count].view(call.batch, num_rows, *query.shape[1:])
        if padded > num_rows:
            rows = F.pad(rows, (0, 0, 0, 0, 0, padded - num_rows))
    o, lse = dense_attention_lse(rows, key, value, float(scale) * float(k_scale), call.causal)
    if padded > num_rows:
        o, lse = o[:, :num_rows], lse[:, :num_rows]
    return o, lse


def whole_step_call(plan):
    """The plan's dense call when it alone computes every row's output (a step of fresh prompts'
    causal squares and nothing else), else None. Its output is then the step's, with no copy."""
    if len(plan.dense) != 1:
        return None
    call = plan.dense[0]
    whole = call.partial_base < 0 and call.q_start == 0 and call.q_count == plan.num_tokens
    return call if whole else None


def run_dense_calls(plan, query, k_cache, v_cache, out, part_out, part_lse, scale, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> None:
    """The plan's dense calls: each writes its rows' outputs and base-2 log-sum-exps to their
    partial slots (or the output, for rows with no other part)."""
    for call in plan.dense:
        o, lse = _dense_output(call, query, k_cache, v_cache, scale, k_scale)
        if call.partial_base < 0:
            store_dense_output(o, None, out[call.q_start:call.q_start + call.q_count], None, v_scale)
        else:
            slots = slice(call.partial_base, call.partial_base + call.q_count)
            store_dense_output(o, lse, part_out[slots], part_lse[slots], v_scale)


def _merge(plan, out, part_out, part_lse) -> None:
    num_merge = plan.merge_tokens.shape[0]
    if num_merge == 0:
        return
    merge_partials_kernel[(num_merge,)](
        part_out, part_lse, plan.merge_tokens, plan.merge_offsets, plan.merge_slots, out,
        out.stride(0), out.stride(1),
        NUM_HEADS=plan.num_heads, HEAD_DIM=out.shape[2], BLOCK_H=next_power_of_2(plan.num_heads),
        num_warps=4,
    )


def prefix_shared_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    plan: PrefixSharedPlanOnDevice,
    scale: float,
    sliding_window: int | None = None,
    positions: torch.Tensor | None = None,  # [num_tokens] int64: each row's position (with a window)
    k_scale: float = 1.0,  # a float8_e4m3fn cache's scales: a stored value q stands for q * scale
    v_scale: float = 1.0,
    side_stream: torch.cuda.Stream | None = None,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]: where the output goes
    beside: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Fused prefix-shared attention: one launch for all prefix and distinct tiles (two with
    plan.tile.split_classes), the plan's dense calls on a library kernel, then the merge kernel
    for rows with several parts.
    side_stream: with split classes on a GPU, the BIG launch runs on this stream, concurrently
    with the SMALL one (they write disjoint rows and partial slots); the merge waits for both.
    The fork and join are stream waits, so they are captured into CUDA graphs as well.
    beside: another kernel's launch for rows the plan leaves out (PrefixSharedPlan.lead_seq_lens),
    run on the current stream while the BIG launch runs on the side stream (else before the launches).
    With a sliding window W, a row at position p sees KV positions in (p - W, p] only: also in
    prefix tiles, where rows far past the prefix see none of its beginning.
    The caches are in the query dtype, or float8_e4m3fn with their scales k_scale / v_scale.
    Returns out [num_tokens, num_heads, head_dim] in the query dtype (`out` itself when given).
    """
    _validate(query, k_cache, v_cache, plan, k_scale, v_scale)
    check(sliding_window is None or not plan.dense,
          "dense calls have no sliding-window path: plan with tile.dense_min_rows=0")
    if sliding_window is not None:
        check(isinstance(sliding_window, int) and sliding_window >= 1,
              f"sliding_window must be an integer >= 1, got {sliding_window!r}")
        check(positions is not None and positions.shape == (query.shape[0],) and positions.dtype == torch.int64,
              "a sliding window needs positions: [num_tokens] int64")
    if out is not None:
        check(out.shape == query.shape and out.dtype == query.dtype and out.is_contiguous()
              and out.device == query.device, "out must be a contiguous tensor shaped like query, on its device")
    whole = whole_step_call(plan) if beside is None and plan.dense_runner is None else None
    if whole is not None:  # a view of cuDNN's output ([B, L, H, D] in memory, as the query's rows)
        o, _ = _dense_output(whole, query, k_cache, v_cache, scale, k_scale)
        out = torch.empty_like(query) if out is None else out
        store_dense_output(o, None, out, None, v_scale)
        return out
    out = torch.empty_like(query) if out is None else out
    slots = max(plan.num_partial_slots, 1)
    part_out = torch.empty((slots, plan.num_heads, query.shape[2]), dtype=torch.float32, device=query.device)
    part_lse = torch.empty((slots, plan.num_heads), dtype=torch.float32, device=query.device)
    launches = _work_lists(plan)
    args = (query, k_cache, v_cache, plan, out, part_out, part_lse, scale)
    tail = (sliding_window, positions, k_scale, v_scale)
    if side_stream is not None and len(launches) == 2 and query.is_cuda:
        # The BIG items of a decode step are few long prefix pieces whose launch, run alone,
        # streams KV below the device's rate (docs/design.md, "Decode attention: two streams").
        current = torch.cuda.current_stream(query.device)
        side_stream.wait_stream(current)
        (big, big_classes, big_count), (small, small_classes, small_count) = launches
        with torch.cuda.stream(side_stream):
            _launch_items(big, *args, big_classes, big_count, *tail)
        _launch_items(small, *args, small_classes, small_count, *tail)
        if beside is not None:
            beside()
        current.wait_stream(side_stream)
    else:
        if beside is not None:
            beside()
        for work, classes, num_items in launches:
            _launch_items(work, *args, classes, num_items, *tail)
    if plan.dense_runner is not None:
        plan.dense_runner(query, k_cache, v_cache, out, part_out, part_lse, scale, k_scale, v_scale)
    else:
        run_dense_calls(plan, query, k_cache, v_cache, out, part_out, part_lse, scale, k_scale, v_scale)
    _merge(plan, out, part_out, part_lse)
    return out
