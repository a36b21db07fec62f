"""Attention on the real steps of an engine run, under each launch variant (H200).

The scheduler runs the workload without a model (batchllm.sched.simulator, the same policy code
as the engine); a few of its steps are rebuilt exactly as the engine builds them (StepInputs, the
fused work list with the engine's tile config) and the attention of one layer is timed on a KV
cache of the engine's size, for each launch variant:

  exact                the default tile table, one fused launch, one program per (item, KV head):
                       the engine's eager path for steps with prefill chunks
  decode-only steps (the engine runs them as CUDA graphs):
  graph_padded         the work list padded with no-op items to the graph's capacity (4 x rows
                       bucket + 1024), one program per padded item (the graph path before
                       persistent launches)
  graph_persistent     the same padded list, one persistent fused launch over the real items
  graph_split_persistent  decode_tile_config: BIG and SMALL items in two padded lists, a persistent
                       class-specialised launch each, the BIG one on a side stream (the
                       engine's graph path now)
  split                decode_tile_config, eager (one program per item)
  steps with prefill chunks:
  split_*              TileConfig.split_classes: a BIG launch, then a SMALL launch, each a
                       class-specialised kernel variant (SMALL BLOCK_N / warps / stages as named)

Times are GPU times of the variant's launches replayed from a CUDA graph (the engine's decode
steps are graphs; eager timing of a 100 us step measured Python launch overhead). Every variant
is checked against `exact` (max abs error). Steps: by default three with prefill
chunks and three decode-only ones per policy (at 20/50/80% of each kind, in run order).

    PYTHONPATH=. python3 benchmarks/engine_steps.py --out engine_steps.json
    TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/engine_steps.py --dry-run   # CPU, tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from attention import bench_us as eager_us

from batchllm.perf.runner import git_commit
from batchllm.perf.workload import make_workload
from batchllm.engine.batch_rows import BatchRows
from batchllm.engine.cuda_graphs import TOKEN_BUCKETS, graph_items_capacity, rows_bucket
from batchllm.engine.step_inputs import build_step_inputs
from batchllm.ops.prefix_attention import prefix_shared_attention
from batchllm.attention_plan.tile_config import decode_tile_config, default_tile_config
from batchllm.attention_plan.work_list import F_PARTIAL_BASE, WORK_FIELDS, build_prefix_shared_plan
from batchllm.ops.plan_device import device_num_sms, plan_to_device
from batchllm.sched.config import SchedulerConfig
from batchllm.sched.simulator import SimRequest, simulate

BLOCK_SIZE = 16
# (name, small_n, small_num_warps, small_num_stages) of the split_* variants
SPLIT_VARIANTS = [("split_n128_w4_s2", 128, 4, 2), ("split_n64_w4_s2", 64, 4, 2), ("split_n64_w4_s3", 64, 4, 3),
                  ("split_n64_w2_s2", 64, 2, 2), ("split_n32_w2_s3", 32, 2, 3)]


def bench_us(fn) -> float:
    """GPU time of fn in microseconds, replayed from a CUDA graph: no host launch gaps between
    the two or three kernels of a variant (on small steps eager timing measured the host)."""
    if not torch.cuda.is_available():
        return eager_us(fn)
    import triton.testing

    fn()  # compile outside the capture
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=40)) * 1e3


def _sched_config(policy: str, kv_tokens: int) -> SchedulerConfig:
    return SchedulerConfig(policy=policy, num_kv_blocks=kv_tokens // BLOCK_SIZE, block_size=BLOCK_SIZE)


def pick_steps(summary: list[tuple[int, bool]], fractions=(0.2, 0.5, 0.8)) -> list[int]:
    """summary: (step index, has prefill chunks) in run order -> indices at `fractions` of each kind."""
    picked = []
    for kind in (True, False):
        steps = [i for i, mixed in summary if mixed == kind]
        picked += sorted({steps[min(len(steps) - 1, int(f * len(steps)))] for f in fractions} if steps else set())
    return sorted(picked)


def record_steps(requests: list[SimRequest], config: SchedulerConfig, wanted: list[int] | None):
    """Run the policy; returns (summary per step, {step index: StepInputs} for `wanted`)."""
    summary, inputs = [], {}
    rows = BatchRows()  # every step's block-table changes are applied, as the runner does

    def on_output(output):
        index = len(summary)
        summary.append((index, output.num_distinct_tokens + output.num_prefix_tokens > 0))
        step_rows = rows.step_rows(output)
        if wanted is not None and index in wanted:
            inputs[index] = build_step_inputs(output, BLOCK_SIZE, step_rows)

    simulate(requests, config, on_output=on_output)
    return summary, inputs


def padded_work(work: np.ndarray, num_tokens: int) -> np.ndarray:
    """The work list as a decode CUDA graph holds it (engine/cuda_graphs.py capacities)."""
    rows = rows_bucket(num_tokens) or TOKEN_BUCKETS[-1]
    capacity = max(graph_items_capacity(rows), work.shape[0])
    padded = np.zeros((capacity, WORK_FIELDS), np.int32)
    padded[:, F_PARTIAL_BASE] = -1
    padded[:work.shape[0]] = work
    return padded


def graph_plan(plan, device, num_sms: int, split: bool):
    """`plan` laid out as a decode CUDA graph holds it (padded lists, device item counts),
    launched persistently; split: BIG and SMALL items in two class-specialised launches."""
    tile = dataclasses.replace(plan.tile, split_classes=split)
    plan = dataclasses.replace(plan, tile=tile)
    lists = plan.class_lists()
    work = [torch.from_numpy(padded_work(items, plan.num_tokens)).to(device) for items in lists]
    counts = torch.tensor([items.shape[0] for items in lists], dtype=torch.int32, device=device)
    return dataclasses.replace(plan_to_device(plan, device), work=work[0], work_big=work[0] if split else None,
                               work_small=work[1] if split else None, num_items=counts,
                               persistent_programs=tile.graph_programs_per_sm * num_sms)


def variants_for(step_inputs, plan, decode_plan, device, num_sms: int) -> dict:
    """name -> device plan of each variant (see the module docstring)."""
    exact = plan_to_device(plan, device)
    out = {"exact": exact}
    decode_only = step_inputs.num_tokens == step_inputs.query_start_loc.shape[0] - 1
    if decode_only:
        work = torch.from_numpy(padded_work(plan.work, step_inputs.num_tokens)).to(device)
        out["graph_padded"] = dataclasses.replace(exact, work=work)
        out["graph_persistent"] = graph_plan(plan, device, num_sms, split=False)
        out["graph_split_persistent"] = graph_plan(decode_plan, device, num_sms, split=True)
        out["split"] = plan_to_device(decode_plan, device)
        return out
    for name, small_n, warps, stages in SPLIT_VARIANTS:
        split_tile = dataclasses.replace(plan.tile, split_classes=True, small_n=small_n, small_num_warps=warps,
                                         small_num_stages=stages)
        out[name] = plan_to_device(dataclasses.replace(plan, tile=split_tile), device)
    return out


def geomean_speedups(rows: list[dict], policies: list[str]) -> dict:
    """Per policy and step kind: each variant's geometric-mean speedup over the kind's baseline
    (decode steps: graph_padded; steps with prefill chunks: exact) on the same steps."""
    summary = {}
    for policy in policies:
        for kind, base in (("decode", "graph_padded"), ("mixed", "exact")):
            chosen = [r for r in rows if r["policy"] == policy and r["kind"] == kind]
            speedups = {}
            for name in sorted({r["variant"] for r in chosen}):
                ratios = [b["us"] / r["us"] for r in chosen if r["variant"] == name and r["valid"]
                          for b in chosen if b["variant"] == base and b["step"] == r["step"]]
                if ratios:
                    speedups[name] = round(math.exp(sum(map(math.log, ratios)) / len(ratios)), 3)
            if speedups:
                summary[f"{policy} {kind} (geomean speedup vs {base})"] = speedups
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="micro:2000:200:16")
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--output-tokens", type=int, default=100)
    parser.add_argument("--policies", default="batchllm,vllm")
    parser.add_argument("--kv-cache-tokens", type=int, default=500_000)
    parser.add_argument("--steps", default="auto", help="'auto' or a comma list of step indices (every policy)")
    parser.add_argument("--out", default="benchmarks/results/engine_steps.json")
    parser.add_argument("--git-commit", default=None,
                        help="commit id to record (default: the checkout's short hash, with -dirty when "
                             "tracked files were changed)")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny workload and heads on CPU (run with TRITON_INTERPRET=1)")
    args = parser.parse_args()
    num_heads, num_kv_heads, head_dim, vocab = 32, 8, 128, 128256  # Llama-3.1-8B
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.dry_run:
        num_heads, num_kv_heads, head_dim = 8, 2, 32
        args.workload, args.requests, args.output_tokens, args.kv_cache_tokens = "micro:40:8:4", 8, 4, 4096
    elif device != "cuda":
        sys.exit("benchmarks/engine_steps.py needs a CUDA device (or --dry-run)")
    num_sms = device_num_sms(device, cpu_num_sms=4)
    workload = make_workload(args.workload, args.requests, args.output_tokens, vocab, 0)
    requests = [SimRequest(tuple(p.tolist()), int(m)) for p, m in zip(workload.prompts, workload.max_tokens)]
    num_blocks = args.kv_cache_tokens // BLOCK_SIZE
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    tile = default_tile_config(head_dim, num_heads // num_kv_heads)
    decode_tile = decode_tile_config(head_dim, num_heads // num_kv_heads)
    scale = head_dim ** -0.5
    side_stream = torch.cuda.Stream() if device == "cuda" else None  # the engine's BIG-launch stream
    rows, notes = [], []
    for policy in args.policies.split(","):
        config = _sched_config(policy, args.kv_cache_tokens)
        if args.steps == "auto":
            summary, _ = record_steps(requests, config, None)
            wanted = pick_steps(summary)
        else:
            wanted = [int(x) for x in args.steps.split(",")]
        summary, steps = record_steps(requests, config, wanted)
        print(f"{policy}: {len(summary)} steps; timing steps {sorted(steps)}", flush=True)
        for index, step_inputs in sorted(steps.items()):
            plan, decode_plan = (build_prefix_shared_plan(
                step_inputs.query_start_loc, step_inputs.seq_lens, step_inputs.shared_kv_lens,
                step_inputs.block_tables, step_inputs.group_ids if policy == "batchllm" else None,
                step_inputs.is_prefix if policy == "batchllm" else None, block_size=BLOCK_SIZE,
                num_kv_heads=num_kv_heads, num_heads=num_heads, head_dim=head_dim, tile=t, num_sms=num_sms)
                for t in (tile, decode_tile))
            query = torch.randn(step_inputs.num_tokens, num_heads, head_dim, dtype=dtype, device=device)
            variants = variants_for(step_inputs, plan, decode_plan, device, num_sms)
            reference = prefix_shared_attention(query, k_cache, v_cache, variants["exact"], scale).float()
            decode_rows = int((np.diff(step_inputs.query_start_loc) == 1).sum())
            for name, device_plan in variants.items():
                side = side_stream if name == "graph_split_persistent" else None
                fn = lambda p=device_plan, q=query, s=side: prefix_shared_attention(q, k_cache, v_cache, p, scale,
                                                                                    side_stream=s)
                try:
                    err = (fn().float() - reference).abs().max().item()
                    us = bench_us(fn)
                except Exception as exc:  # noqa: BLE001 -- a variant that fails is a result too
                    notes.append(f"{policy} step {index} {name}: {exc!r}"[:400])
                    continue
                row = {"policy": policy, "step": index, "kind": "mixed" if step_inputs.num_tokens > decode_rows
                       else "decode", "num_tokens": step_inputs.num_tokens, "decode_rows": decode_rows,
                       "items": int(plan.work.shape[0]), "variant": name, "us": round(us, 2),
                       "max_abs_err": err, "valid": err < 5e-2}
                rows.append(row)
                print(json.dumps(row), flush=True)
    summary_rows = geomean_speedups(rows, args.policies.split(","))
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
              "date": datetime.date.today().isoformat(), "git_commit": args.git_commit or git_commit(),
              "workload": args.workload, "requests": args.requests, "kv_cache_tokens": args.kv_cache_tokens,
              "tile": vars(tile), "decode_tile": vars(decode_tile), "summary": summary_rows, "rows": rows, "notes": notes}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    print(json.dumps(summary_rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
