"""Tile configs of the attention kernel (H200): which one runs steps with prefill chunks fastest,
and which one decode steps?

Steps that hold prefill chunks spend most of their attention time in BIG tiles (a group's rows x
its prefix, a prefill chunk x its own KV); decode-only steps keep the default table (they run as
CUDA graphs). This sweep times each `tile_candidates` config on such steps, for the fused
kernel in the engine's work order ("auto") and for plain paged attention (the baselines' path),
each validated against the float32 reference first:

    PYTHONPATH=. python3 benchmarks/prefill_tiles.py --out prefill_tiles.json

Scenarios: the mixed settings of benchmarks/attention.py (7 prefill chunks + 256 decode rows) and one step shaped like
the engine's on micro 2000/200 sd16 (a prefix chunk finishing a 2000-token prefix, 4 members' first
200-token chunks, 256 decode rows of 16 running groups). Decode scenarios (kind "decode"): the
decode settings of benchmarks/attention.py and a decode step shaped like the engine's on micro 2000/200 sd16 (35
running groups of 16 members). Prints the best config per scenario kind by geometric mean.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import attention  # noqa: E402
from attention import BLOCK_SIZE, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, SETTINGS, bench_us, scenario_seqs  # noqa: E402

from batchllm.perf.runner import git_commit  # noqa: E402
from batchllm.attention_plan.work_list import build_prefix_shared_plan as build_paged_plan  # noqa: E402
from batchllm.ops.prefix_attention import prefix_shared_attention  # noqa: E402
from batchllm.ops.reference import paged_attention_reference  # noqa: E402
from batchllm.attention_plan.tile_config import TileConfig, decode_tile_config, default_tile_config  # noqa: E402
from batchllm.attention_plan.checks import next_power_of_2  # noqa: E402
from batchllm.attention_plan.work_list import build_prefix_shared_plan  # noqa: E402
from batchllm.ops.plan_device import device_num_sms, plan_to_device  # noqa: E402
from tests.synthetic_batch import SeqSpec, make_batch  # noqa: E402


def tile_candidates(head_dim: int, group_size: int) -> dict[str, TileConfig]:
    """Named configs swept on steps with prefill chunks and on decode steps: the BIG tiles carry
    most of a prefill step's attention work, so larger MMA tiles / more warps may pay even though
    the SMALL (decode) tiles of the same launch share the warp count; decode steps stream KV, where
    pipeline depth (num_stages) and BLOCK_N matter."""
    from dataclasses import replace

    packed_min = max(16, next_power_of_2(group_size))
    base = default_tile_config(head_dim, group_size, interpret=False)

    def wide(big_m: int, big_n: int, num_warps: int, num_stages: int) -> TileConfig:
        return TileConfig(small_m=packed_min, small_n=128, big_m=max(big_m, packed_min), big_n=big_n,
                          num_warps=num_warps, num_stages=num_stages, min_kv_split_tokens=512)

    return {
        "default": base,
        "s3": replace(base, num_stages=3),
        "sn64_s3": replace(base, small_n=64, num_stages=3),
        "sn64_s4": replace(base, small_n=64, num_stages=4),
        "m128_w8": wide(128, 64, 8, 2),
        "m128_w8_s3": wide(128, 64, 8, 3),
        "m64_n128_w4": wide(64, 128, 4, 2),
        "m128_n128_w8": wide(128, 128, 8, 2),
        "split256": replace(base, min_kv_split_tokens=256),
        # class-specialised BIG and SMALL launches (the decode steps' config, decode_tile_config)
        "split_classes": decode_tile_config(head_dim, group_size, interpret=False),
    }


def engine_like_step(prefix: int = 2000, distinct: int = 200, chunk: int = 976, groups: int = 16) -> list[SeqSpec]:
    seqs = [SeqSpec(chunk, prefix, 0, 0, is_prefix=True)]  # the rest of group 0's prefix
    seqs += [SeqSpec(distinct, prefix + distinct, prefix, 0) for _ in range(4)]  # its members' first chunks
    for g in range(1, groups + 1):  # running groups, 16 decoding members each
        seqs += [SeqSpec(1, prefix + distinct + 7 * m + g, prefix, g) for m in range(16)]
    return seqs


def scenario_kind(where: str) -> str:
    return "decode" if "decode" in where else "prefill"


def engine_like_decode_step(prefix: int = 2000, distinct: int = 200, groups: int = 35) -> list[SeqSpec]:
    return [SeqSpec(1, prefix + distinct + 3 * m + g, prefix, g) for g in range(groups) for m in range(16)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/prefill_tiles.json")
    parser.add_argument("--git-commit", default=None,
                        help="commit id to record (default: the checkout's short hash, with -dirty when "
                             "tracked files were changed)")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1)")
    args = parser.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    scale = HEAD_DIM ** -0.5
    configs = tile_candidates(HEAD_DIM, NUM_HEADS // NUM_KV_HEADS)
    if args.dry_run:
        attention.NUM_DECODE = 4
        scenarios = [(f"{p}/{d}/{g} mixed", scenario_seqs(p, d, g, True, False)) for p, d, g in attention.DRY_SETTINGS]
        scenarios.append(("engine-like (tiny)", engine_like_step(40, 20, 24, 1)))
        scenarios.append(("engine-like decode (tiny)", engine_like_decode_step(40, 20, 2)))
    else:
        scenarios = [(f"{p}/{d}/{g} mixed", scenario_seqs(p, d, g, True, False)) for p, d, g in SETTINGS]
        scenarios.append(("engine-like micro 2000/200 sd16 step", engine_like_step()))
        scenarios += [(f"{p}/{d}/{g} decode", scenario_seqs(p, d, g, False, False)) for p, d, g in SETTINGS]
        scenarios.append(("engine-like micro 2000/200 sd16 decode", engine_like_decode_step()))
    rows, notes = [], []
    for where, seqs in scenarios:
        b = make_batch(seqs, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
                       dtype=dtype, device=dev)
        ref = paged_attention_reference(b.query, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens,
                                        b.shared_kv_lens, b.block_tables, scale).float()
        meta = b.metadata_numpy()
        for name, tile in configs.items():
            kw = {"block_size": BLOCK_SIZE, "num_kv_heads": NUM_KV_HEADS, "num_heads": NUM_HEADS,
                  "head_dim": HEAD_DIM, "tile": tile, "num_sms": device_num_sms(dev)}
            plans = {"fused_auto": plan_to_device(build_prefix_shared_plan(**meta, order="auto", **kw), dev),
                     "plain": plan_to_device(build_paged_plan(meta["query_start_loc"], meta["seq_lens"],
                                                              meta["shared_kv_lens"], meta["block_tables"], **kw), dev)}
            for impl, plan in plans.items():
                fn = lambda plan=plan: prefix_shared_attention(b.query, b.k_cache, b.v_cache, plan, scale)  # noqa: E731
                try:
                    err = (fn().float() - ref).abs().max().item()
                    us = bench_us(fn)
                except Exception as exc:  # noqa: BLE001 -- a config that does not compile is a result too
                    notes.append(f"{name} {impl} on {where}: {exc!r}"[:400])
                    continue
                row = {"scenario": where, "kind": scenario_kind(where), "config": name, "impl": impl,
                       "us": round(us, 2), "max_abs_err": err, "valid": err < 5e-2}
                rows.append(row)
                print(json.dumps(row), flush=True)
        del b, ref
    best = {}
    for kind in ("prefill", "decode"):
        num_kind_scenarios = sum(scenario_kind(where) == kind for where, _ in scenarios)
        for impl in ("fused_auto", "plain"):
            means = {}
            for name in configs:
                times = [r["us"] for r in rows if r["impl"] == impl and r["config"] == name and r["valid"]
                         and r["kind"] == kind]
                if times and len(times) == num_kind_scenarios:
                    means[name] = math.exp(sum(math.log(t) for t in times) / len(times))
            if means:
                winner = min(means, key=means.get)
                best[f"{impl} {kind}"] = {
                    "config": winner, "geomean_us": {k: round(v, 1) for k, v in means.items()},
                    "speedup_vs_default": round(means["default"] / means[winner], 3) if "default" in means else None}
    result = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
              "date": datetime.date.today().isoformat(), "git_commit": args.git_commit or git_commit(),
              "configs": {k: vars(v) for k, v in configs.items()}, "best": best, "rows": rows, "notes": notes}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    print(json.dumps(best, indent=1))
    print("BEST_FUSED_PREFILL", best.get("fused_auto prefill", {}).get("config", "default"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
