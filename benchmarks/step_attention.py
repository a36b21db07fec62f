"""Attention of one engine step, one layer of Llama-3.1-8B heads, on a bf16 and a float8_e4m3fn cache.

--steps decode: the CUDA-graph steps' decode rows at the shapes of uniform 1000/1000, of one
cache-full wave of uniform 20000/2000 (80 rows of about 21,000 positions) and of micro 2000/200
sd16 (64 groups of 16 members over a 2000-token prefix, 200-280 own positions a row), as the
graphs launch them (persistent, BIG and SMALL items apart) and timed as replays of a CUDA graph
that holds one layer's call: the bf16 row on a bf16 cache, the FP8 row on an FP8 cache, and on a
Hopper GPU with FlashInfer installed the `xqa` backend's kernel (XQA) on the FP8 cache, which
reads a group's prefix through each member's table (the engine's `xqa` runs it only on rows that
share no prefix). The FP8 rows' outputs are checked against the bf16 row run on the same cache
converted to bf16 (every e4m3 value is a bf16 one) first. Reports ms a layer and the cache's
bytes read per second (a group's prefix counted once); on the shared step also each launch alone:
BIG (the prefixes) and SMALL (the rows' own positions). --between-gemms: also each decode row in one
graph after the QKV, O, gate_up and down projections of one layer at the step's rows (FP8), timed
after 3 s of replays, at the power cap where the engine's decode steps run (`layer_ms`), and those
projections alone (`gemms_ms`).

--steps prefill: steps with prefill chunks (eager launches) at the shapes of uniform 128/128 and
2048/128 and of a shared-prefix step, with the default table's one fused launch ("fused") and with
the prefill table (prefill_tile_config, "prefill_table"), on either cache. Every output is checked
against the fused launch on the bf16 cache converted from the FP8 one. Reports ms a layer.

Usage: PYTHONPATH=. python3 benchmarks/step_attention.py --out step_attention.json [--steps decode prefill]
  [--between-gemms] [--dry-run: tiny shapes on CPU, TRITON_INTERPRET=1]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import time

import numpy as np
import torch

from batchllm.attention_plan.tile_config import TileConfig, decode_tile_config, default_tile_config, prefill_tile_config
from batchllm.attention_plan.work_list import build_prefix_shared_plan
from batchllm.ops.plan_device import device_num_sms, plan_to_device
from batchllm.ops.prefix_attention import prefix_shared_attention
from batchllm.ops.xqa_decode import xqa_installed
from batchllm.perf.runner import git_commit
from tests.synthetic_batch import SeqSpec, make_batch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16  # Llama-3.1-8B
GROUP = NUM_HEADS // NUM_KV_HEADS
# (decode rows, mean context): the 1000/1000 run's decode steps, and 20000/2000's (the cache holds 80)
SHAPES = [(600, 1200), (1700, 1000), (80, 21000)]
DRY_SHAPES = [(6, 40)]
# (groups, members, prefix, own positions from, to): micro 2000/200 sd16's decode steps
SHARED_SHAPES = [(64, 16, 2000, 200, 280)]
DRY_SHARED_SHAPES = [(2, 3, 40, 4, 12)]


def decode_step(num_rows: int, mean_context: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A synthetic decode step: contexts drawn within +-20% of mean_context, blocks shuffled."""
    rng = np.random.default_rng(seed)
    seqs = [SeqSpec(1, int(mean_context * rng.uniform(0.8, 1.2))) for _ in range(num_rows)]
    return _batch(seqs, dtype, device, seed)


def shared_decode_step(num_groups: int, members: int, prefix: int, own_from: int, own_to: int, dtype: torch.dtype,
                       device: torch.device, seed: int = 0):
    """A synthetic decode step of groups: each member one row over its group's prefix and
    own_from..own_to - 1 positions of its own."""
    rng = np.random.default_rng(seed)
    seqs = [SeqSpec(1, prefix + int(rng.integers(own_from, own_to)), shared_kv_len=prefix, group_id=g)
            for g in range(num_groups) for _ in range(members)]
    return _batch(seqs, dtype, device, seed)


def prefill_steps(dry_run: bool, seed: int = 0) -> dict[str, list[SeqSpec]]:
    """Steps with prefill chunks: decode rows beside fresh prompts of uniform 128/128 (7,100 rows
    within 128-255 positions, 34 prompts of 128) and 2048/128 (800 rows within 2048-2175 positions,
    7 prompts of 2048), and 40 groups of 16 decoding members over a 2000-token shared prefix (up to
    200 positions of their own) beside a 2048-row prefix chunk of the next group."""
    rng = np.random.default_rng(seed)
    (rows_a, prompts_a, len_a), (rows_b, prompts_b, len_b, out_b) = (
        ((12, 2, 16), (6, 1, 48, 8)) if dry_run else ((7100, 34, 128), (800, 7, 2048, 128)))
    groups, members, prefix, own, chunk = (2, 3, 40, 8, 32) if dry_run else (40, 16, 2000, 200, 2048)
    steps = {"128/128": ([SeqSpec(1, int(rng.integers(len_a + 1, 2 * len_a))) for _ in range(rows_a)]
                         + [SeqSpec(len_a, len_a) for _ in range(prompts_a)])}
    steps["2048/128"] = ([SeqSpec(1, int(rng.integers(len_b + 1, len_b + out_b))) for _ in range(rows_b)]
                         + [SeqSpec(len_b, len_b) for _ in range(prompts_b)])
    steps["shared prefixes"] = ([SeqSpec(1, prefix + int(rng.integers(1, own)), shared_kv_len=prefix, group_id=g)
                                 for g in range(groups) for _ in range(members)]
                                + [SeqSpec(chunk, chunk, group_id=groups, is_prefix=True)])
    return steps


def _batch(seqs: list[SeqSpec], dtype: torch.dtype, device: torch.device, seed: int = 0):
    return make_batch(seqs, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
                      dtype=dtype, device=device, seed=seed)


def graph_plan(batch, tile: TileConfig, device: torch.device):
    """The step's work list as a CUDA graph launches it: persistent programs over the BIG and the
    SMALL items."""
    num_sms = device_num_sms(device)
    plan = build_prefix_shared_plan(**batch.metadata_numpy(), block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                                    num_heads=NUM_HEADS, head_dim=HEAD_DIM, tile=tile, num_sms=num_sms,
                                    programs_per_sm=tile.graph_programs_per_sm)
    counts = torch.from_numpy(plan.item_counts()).to(device)
    return dataclasses.replace(plan_to_device(plan, device), num_items=counts,
                               persistent_programs=num_sms * tile.graph_programs_per_sm)


def eager_plan(batch, tile: TileConfig, device: torch.device):
    """The step's work list as an eager step launches it (the backend's)."""
    return plan_to_device(build_prefix_shared_plan(**batch.metadata_numpy(), block_size=BLOCK_SIZE,
                                                   num_kv_heads=NUM_KV_HEADS, num_heads=NUM_HEADS, head_dim=HEAD_DIM,
                                                   tile=tile, num_sms=device_num_sms(device)), device)


def one_launch(batch, plan, launch: str, k_cache, v_cache, scale: float, side):
    """The step with only its BIG ("big") or SMALL ("small") items run, and no merge: the other
    persistent launch finds no items. What each class of the graph step costs on its own."""
    big, small, unpacked = (int(n) for n in plan.num_items.tolist())
    counts = [big, 0, 0] if launch == "big" else [0, small, unpacked]
    alone = dataclasses.replace(plan, num_items=torch.tensor(counts, dtype=torch.int32, device=plan.num_items.device),
                                merge_tokens=plan.merge_tokens[:0])
    return lambda: prefix_shared_attention(batch.query, k_cache, v_cache, alone, scale, side_stream=side)


SUSTAIN_WARMUP_MS, SUSTAIN_REP_MS = 3000, 1000


def time_ms(fn, dry_run: bool, graph: bool = False, sustained: bool = False) -> float:
    """GPU ms of one call of fn (the median of triton's do_bench); graph: of one replay of fn
    captured in a CUDA graph, as the engine's decode steps run it. Eager, a decode step's host
    work (argument checks, launch arguments, three launches) takes longer than its kernels on the
    shared step, so a loop of eager calls would time the host. sustained: after 3 s of calls, over
    1 s of them: a board running GEMMs reaches its power cap, and the lower clock that comes with
    it, only after a second or so; the default 0.2 s sees it cold."""
    if dry_run:
        started = time.perf_counter()
        fn()
        return (time.perf_counter() - started) * 1e3
    import triton.testing

    if graph:
        fn()  # compiles and plans outside the capture
        torch.cuda.synchronize()
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            fn()
        fn = captured.replay
    warmup_ms, rep_ms = (SUSTAIN_WARMUP_MS, SUSTAIN_REP_MS) if sustained else (10, 200)
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms))


def step_gemms(num_rows: int, device: torch.device, dry_run: bool):
    """The linear layers of one Llama-3.1-8B layer at num_rows rows, as a decode step runs them
    before and after its attention (FP8 weights and activations on the GPU; tiny float32 ones in a
    dry run): a callable. Timed with the attention in one graph, they hold the board at the power
    state of a real step, where an attention kernel may run slower than alone."""
    if dry_run:
        x, weights = torch.randn(num_rows, 64), [torch.randn(n, 64) for n in (96, 64, 128, 64)]
        return lambda: [x @ w.t() for w in weights]
    from batchllm.ops.fp8 import fp8_linear, quantize_weight_rows
    from batchllm.ops.fp8_kernels import quantize_rows

    hidden, intermediate = 4096, 14336
    layers = [(6144, hidden), (hidden, NUM_HEADS * HEAD_DIM), (2 * intermediate, hidden), (hidden, intermediate)]
    weights = [quantize_weight_rows(torch.randn(n, k, device=device, dtype=torch.bfloat16) / k ** 0.5)
               for n, k in layers]
    inputs = [quantize_rows(torch.randn(num_rows, k, device=device, dtype=torch.bfloat16)) for _, k in layers]
    return lambda: [fp8_linear(x, w, scale, None, torch.bfloat16) for x, (w, scale) in zip(inputs, weights)]


def _caches(batch):
    """The batch's caches as FP8, and those converted back to the query dtype (the same values)."""
    k8, v8 = batch.k_cache.to(torch.float8_e4m3fn), batch.v_cache.to(torch.float8_e4m3fn)
    return (k8, v8), (k8.to(batch.query.dtype), v8.to(batch.query.dtype))


def _cache_dtype(cache: torch.Tensor) -> str:
    return str(cache.dtype).replace("torch.", "")


def measure(batch, shape: dict, device: torch.device, dry_run: bool, between_gemms: bool = False) -> list[dict]:
    """The decode rows of one CUDA-graph step, bf16 row and FP8 row (and XQA where every shared
    prefix ends on a block boundary); `shape` labels the rows. between_gemms: also each row between
    its step's linear layers (step_gemms) in one graph, `layer_ms`, and those layers alone, `gemms_ms`."""
    gemms = step_gemms(batch.query.shape[0], device, dry_run) if between_gemms else None
    with_gemms = lambda run: (lambda: (gemms(), run()))  # noqa: E731
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    scale = HEAD_DIM ** -0.5
    (k8, v8), converted = _caches(batch)
    bf16_row = decode_tile_config(HEAD_DIM, GROUP, interpret=dry_run)
    fp8_row = decode_tile_config(HEAD_DIM, GROUP, interpret=dry_run, kv_fp8=True)
    runs = {
        "bf16_row": (bf16_row, batch.k_cache, batch.v_cache),
        "fp8_row": (fp8_row, k8, v8),
    }
    expected = prefix_shared_attention(batch.query, *converted, graph_plan(batch, bf16_row, device), scale,
                                       side_stream=side).float()
    # the positions the step reads: a group's prefix once, every row's own positions
    num_positions = int((batch.seq_lens - batch.shared_kv_lens).sum())
    num_prefix_positions = sum(int(batch.shared_kv_lens[batch.group_ids == g].max())
                               for g in set(batch.group_ids.tolist()) if g >= 0)
    num_positions += num_prefix_positions
    rows = []
    for name, (tile, k_cache, v_cache) in runs.items():
        plan = graph_plan(batch, tile, device)
        run = lambda: prefix_shared_attention(batch.query, k_cache, v_cache, plan, scale, side_stream=side)  # noqa: E731
        if name == "fp8_row":
            torch.testing.assert_close(run().float(), expected, atol=3e-3, rtol=3e-3)
        ms = time_ms(run, dry_run, graph=True)
        bytes_per_position = NUM_KV_HEADS * HEAD_DIM * 2 * k_cache.element_size()
        cache_bytes = num_positions * bytes_per_position
        row = {"steps": "decode", **shape, "row": name, "cache_dtype": _cache_dtype(k_cache),
               "cache_bytes": cache_bytes, "ms_per_layer": round(ms, 3),
               "cache_tb_per_s": round(cache_bytes / ms / 1e9, 2)}
        if gemms is not None:
            row["layer_ms"] = round(time_ms(with_gemms(run), dry_run, graph=True, sustained=True), 3)
        if num_prefix_positions:  # the BIG launch reads the prefixes, the SMALL one the rows' own positions
            for launch, positions in (("big", num_prefix_positions), ("small", num_positions - num_prefix_positions)):
                ms = time_ms(one_launch(batch, plan, launch, k_cache, v_cache, scale, side), dry_run, graph=True)
                launch_bytes = positions * bytes_per_position
                row.update({f"{launch}_launch_bytes": launch_bytes, f"{launch}_launch_ms": round(ms, 3),
                            f"{launch}_launch_tb_per_s": round(launch_bytes / ms / 1e9, 2)})
        rows.append(row)
    # XQA reads position p of a row in its table's block p // BLOCK_SIZE: rows of a group whose
    # prefix ends on a block boundary are laid out so (a member's table is the prefix's blocks, then
    # its own), and XQA reads the prefix once for each member, where the L2 cache may serve repeats
    aligned = not (batch.shared_kv_lens % BLOCK_SIZE).any()
    if aligned and not dry_run and xqa_installed() and torch.cuda.get_device_capability(device) >= (9, 0):
        from batchllm.ops.xqa_decode import XqaDecode

        xqa = XqaDecode(device)
        run = lambda: xqa(batch.query, k8, v8, batch.block_tables, batch.seq_lens, scale)  # noqa: E731
        # FP8 products (the query and the probabilities rounded to e4m3): a looser check
        torch.testing.assert_close(run().float(), expected, atol=5e-2, rtol=5e-2)
        ms = time_ms(run, dry_run, graph=True)
        cache_bytes = num_positions * NUM_KV_HEADS * HEAD_DIM * 2
        rows.append({"steps": "decode", **shape, "row": "xqa",
                     "cache_dtype": _cache_dtype(k8), "cache_bytes": cache_bytes, "ms_per_layer": round(ms, 3),
                     "cache_tb_per_s": round(cache_bytes / ms / 1e9, 2)})
        if gemms is not None:
            rows[-1]["layer_ms"] = round(time_ms(with_gemms(run), dry_run, graph=True, sustained=True), 3)
    if gemms is not None:
        gemms_ms = round(time_ms(gemms, dry_run, graph=True, sustained=True), 3)
        for row in rows:
            row["gemms_ms"] = gemms_ms
    return rows


def measure_prefill(name: str, seqs: list[SeqSpec], device: torch.device, dry_run: bool) -> list[dict]:
    """One step with prefill chunks: the fused launch and the prefill table, on a bf16 and an FP8 cache."""
    dtype = torch.float32 if dry_run else torch.bfloat16
    batch = _batch(seqs, dtype, device)
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    scale = HEAD_DIM ** -0.5
    fp8, converted = _caches(batch)
    fused = default_tile_config(HEAD_DIM, GROUP, interpret=dry_run)
    expected = prefix_shared_attention(batch.query, *converted, eager_plan(batch, fused, device), scale,
                                       side_stream=side).float()
    rows = []
    for caches, kv_fp8 in ((converted, False), (fp8, True)):
        for table, tile in (("fused", fused), ("prefill_table", prefill_tile_config(HEAD_DIM, GROUP, dry_run, kv_fp8))):
            plan = eager_plan(batch, tile, device)
            run = lambda: prefix_shared_attention(batch.query, *caches, plan, scale, side_stream=side)  # noqa: E731
            # float16 MMAs round the probabilities differently from bfloat16 ones: a bf16 unit at most
            torch.testing.assert_close(run().float(), expected, atol=2e-2, rtol=2e-2)
            rows.append({"steps": "prefill", "shape": name, "query_rows": batch.query.shape[0],
                         "kv_positions": int(batch.seq_lens.sum()), "row": table,
                         "cache_dtype": _cache_dtype(caches[0]), "split_classes": tile.split_classes,
                         "fp8_conversion": tile.fp8_conversion if kv_fp8 else None,
                         "ms_per_layer": round(time_ms(run, dry_run), 3)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="step_attention.json")
    parser.add_argument("--steps", nargs="+", choices=("decode", "prefill"), default=["decode", "prefill"],
                        help="which steps to time (default: both)")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--between-gemms", action="store_true",
                        help="also time each decode row between its step's FP8 linear layers (layer_ms)")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    rows = []
    if "decode" in args.steps:
        dtype = torch.float32 if args.dry_run else torch.bfloat16
        # built one at a time, so that only one step's caches are on the device at once
        plain = ((decode_step(n, context, dtype, device), {"decode_rows": n, "mean_context": context})
                 for n, context in (DRY_SHAPES if args.dry_run else SHAPES))
        shared = ((shared_decode_step(*group, dtype, device),
                   {"decode_rows": group[0] * group[1], "groups": group[0], "prefix": group[2],
                    "own_positions": list(group[3:])})
                  for group in (DRY_SHARED_SHAPES if args.dry_run else SHARED_SHAPES))
        for batch, shape in itertools.chain(plain, shared):
            found = measure(batch, shape, device, args.dry_run, args.between_gemms)
            del batch
            rows.extend(found)
            print(*(json.dumps(row) for row in found), sep="\n", flush=True)
    if "prefill" in args.steps:
        for name, seqs in prefill_steps(args.dry_run).items():
            rows.extend(measure_prefill(name, seqs, device, args.dry_run))
            print(*(json.dumps(row) for row in rows[-4:]), sep="\n", flush=True)
    result = {"git_commit": git_commit(), "date": datetime.date.today().isoformat(),
              "device": "cpu" if args.dry_run else torch.cuda.get_device_name(device), "rows": rows}
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
