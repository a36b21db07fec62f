"""Decode attention of the engine's CUDA-graph steps: the bf16 row on a bf16 cache and the FP8 row
on a float8_e4m3fn cache, as the graphs launch them (persistent, BIG and SMALL items apart), at the
decode shapes of uniform 1000/1000 (Llama-3.1-8B heads, one layer). Reports ms a layer and the
cache's bytes read per second. The FP8 row's output is checked against the bf16 row run on the
same cache converted to bf16 (every e4m3 value is a bf16 one) first.

Usage: PYTHONPATH=. python3 benchmarks/decode_attention.py --out decode_attention.json
  [--dry-run: tiny shapes on CPU, TRITON_INTERPRET=1]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import time

import numpy as np
import torch

from batchllm.attention_plan.tile_config import TileConfig, decode_tile_config
from batchllm.attention_plan.work_list import build_prefix_shared_plan
from batchllm.ops.plan_device import device_num_sms, plan_to_device
from batchllm.ops.prefix_attention import prefix_shared_attention
from batchllm.perf.runner import git_commit
from tests.synthetic_batch import SeqSpec, make_batch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16  # Llama-3.1-8B
SHAPES = [(600, 1200), (1700, 1000)]  # (decode rows, mean context): the 1000/1000 run's decode steps
DRY_SHAPES = [(6, 40)]


def decode_step(num_rows: int, mean_context: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A synthetic decode step: contexts drawn within +-20% of mean_context, blocks shuffled."""
    rng = np.random.default_rng(seed)
    seqs = [SeqSpec(1, int(mean_context * rng.uniform(0.8, 1.2))) for _ in range(num_rows)]
    return make_batch(seqs, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
                      dtype=dtype, device=device, seed=seed)


def graph_plan(batch, tile: TileConfig, device: torch.device):
    """The step's work list as a CUDA graph launches it: persistent programs over the BIG and the
    SMALL items."""
    num_sms = device_num_sms(device)
    plan = build_prefix_shared_plan(**batch.metadata_numpy(), block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                                    num_heads=NUM_HEADS, head_dim=HEAD_DIM, tile=tile, num_sms=num_sms,
                                    programs_per_sm=tile.graph_programs_per_sm)
    big, small = plan.class_lists()
    counts = torch.tensor([big.shape[0], small.shape[0]], dtype=torch.int32, device=device)
    return dataclasses.replace(plan_to_device(plan, device), num_items=counts,
                               persistent_programs=num_sms * tile.graph_programs_per_sm)


def time_ms(fn, dry_run: bool) -> float:
    if dry_run:
        started = time.perf_counter()
        fn()
        return (time.perf_counter() - started) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=200))


def measure(num_rows: int, mean_context: int, device: torch.device, dry_run: bool) -> list[dict]:
    dtype = torch.float32 if dry_run else torch.bfloat16
    batch = decode_step(num_rows, mean_context, dtype, device)
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    scale = HEAD_DIM ** -0.5
    k8, v8 = batch.k_cache.to(torch.float8_e4m3fn), batch.v_cache.to(torch.float8_e4m3fn)
    bf16_row = decode_tile_config(HEAD_DIM, NUM_HEADS // NUM_KV_HEADS, interpret=dry_run)
    fp8_row = decode_tile_config(HEAD_DIM, NUM_HEADS // NUM_KV_HEADS, interpret=dry_run, kv_fp8=True)
    runs = {
        "bf16_row": (bf16_row, batch.k_cache, batch.v_cache),
        "fp8_row": (fp8_row, k8, v8),
    }
    expected = prefix_shared_attention(batch.query, k8.to(dtype), v8.to(dtype), graph_plan(batch, bf16_row, device),
                                       scale, side_stream=side).float()
    num_positions = int(batch.seq_lens.sum())
    rows = []
    for name, (tile, k_cache, v_cache) in runs.items():
        plan = graph_plan(batch, tile, device)
        run = lambda: prefix_shared_attention(batch.query, k_cache, v_cache, plan, scale, side_stream=side)  # noqa: E731
        if name == "fp8_row":
            torch.testing.assert_close(run().float(), expected, atol=3e-3, rtol=3e-3)
        ms = time_ms(run, dry_run)
        cache_bytes = num_positions * NUM_KV_HEADS * HEAD_DIM * 2 * k_cache.element_size()
        rows.append({"decode_rows": num_rows, "mean_context": mean_context, "row": name,
                     "cache_dtype": str(k_cache.dtype).replace("torch.", ""), "cache_bytes": cache_bytes,
                     "ms_per_layer": round(ms, 3),
                     "cache_tb_per_s": round(cache_bytes / ms / 1e9, 2)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="decode_attention.json")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    rows = []
    for num_rows, mean_context in (DRY_SHAPES if args.dry_run else SHAPES):
        for row in measure(num_rows, mean_context, device, args.dry_run):
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"git_commit": git_commit(), "date": datetime.date.today().isoformat(),
              "device": "cpu" if args.dry_run else torch.cuda.get_device_name(device), "rows": rows}
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
