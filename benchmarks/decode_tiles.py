"""Decode attention: the unique-KV streaming rate of the engine's decode launches under tile
configs and KV cache layouts (H200).

Pure decode of 256 requests in the settings of benchmarks/attention.py (prefix / distinct /
requests per group). Every candidate runs the engine's decode path: the work list laid out as a
decode CUDA graph holds it (padded lists, device item counts), the BIG and SMALL items in two
persistent class-specialised launches (one after the other, or overlapped: the BIG one on a side
stream, as the engine runs them), then the merge kernel, all replayed from a CUDA graph.
The rate is the unique KV bytes (each group's prefix once, each request's own KV) over the GPU
time, as in benchmarks/attention.py.

Cache layouts (the kernels take the cache strides, so both are the same [blocks, page,
kv_heads, head_dim] tensor to them):
  nhd  the engine's storage: within a page, token-major; one KV head's 16 tokens of a page are
       16 pieces of head_dim values, num_kv_heads x head_dim apart
  hnd  head-major storage [blocks, kv_heads, page, head_dim] seen through a permuted view: one KV
       head's page is one contiguous piece

Grids (--grids, instead of the search): the engine gives both persistent launches
graph_programs_per_sm x SMs programs. This times the SMALL launch alone on each grid of
GRID_SMALL, then both launches (overlapped) on each pair of GRID_BIG x GRID_SMALL grids: whether
a SMALL launch's rate grows with its programs and whether grids small enough for both launches'
programs to be resident together let them overlap.

Search: coordinate descent from decode_tile_config with the launches overlapped, per layout
(--layouts; nhd alone by default). Each field of SWEEP is tried at
each of its values in turn and the value with the least geometric-mean time over the settings is
kept; two passes. Each candidate is checked against the float32 reference first. The starting
config's time is also split into its BIG launch, its SMALL launch and the merge.

    PYTHONPATH=. python3 benchmarks/decode_tiles.py --out decode_tiles.json
    PYTHONPATH=. python3 benchmarks/decode_tiles.py --grids --out decode_grids.json
    TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/decode_tiles.py --dry-run   # CPU, tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from attention import BLOCK_SIZE, DRY_SETTINGS, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, SETTINGS, kv_bytes_unique, scenario_seqs
from engine_steps import bench_us, graph_plan

from batchllm.perf.runner import git_commit
from batchllm.ops.prefix_attention import _launch_items, _merge, prefix_shared_attention
from batchllm.ops.reference import paged_attention_reference
from batchllm.attention_plan.tile_config import decode_tile_config
from batchllm.attention_plan.work_list import build_prefix_shared_plan
from batchllm.ops.plan_device import device_num_sms
from tests.synthetic_batch import make_batch

# field -> values tried; split_programs_per_sm is the plan's split-KV target (programs per SM),
# the others are TileConfig fields
SWEEP = {
    "overlap": (False, True),
    "small_n": (32, 64, 128),
    "small_num_stages": (2, 3, 4),
    "small_num_warps": (2, 4, 8),
    "big_n": (32, 64, 128),
    "num_stages": (2, 3, 4),
    "num_warps": (4, 8),
    "min_kv_split_tokens": (256, 512, 1024, 2048),
    "split_programs_per_sm": (2, 4, 8),
    "graph_programs_per_sm": (2, 4, 8),
}


@dataclasses.dataclass(frozen=True)
class Candidate:
    tile: object  # TileConfig
    split_programs_per_sm: int = 4
    overlap: bool = True  # the BIG launch on a side stream, concurrent with the SMALL one

    def with_field(self, field: str, value) -> "Candidate":
        if field in ("split_programs_per_sm", "overlap"):
            return dataclasses.replace(self, **{field: value})
        return dataclasses.replace(self, tile=dataclasses.replace(self.tile, **{field: value}))

    def key(self) -> str:
        t = self.tile
        launches = "overlap" if self.overlap else "serial"
        return (f"{launches} small {t.small_n}/w{t.small_num_warps}/s{t.small_num_stages} "
                f"big {t.big_n}/w{t.num_warps}/s{t.num_stages} "
                f"split>={t.min_kv_split_tokens}@{self.split_programs_per_sm}/sm graph {t.graph_programs_per_sm}/sm")


# --grids: programs per SM of each persistent launch (the engine gives both graph_programs_per_sm)
GRID_BIG = (1, 2, 4)
GRID_SMALL = (1, 2, 3, 4, 8)

LAYOUTS = ("nhd", "hnd")


def as_layout(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values in `layout` storage, indexed [blocks, page, kv_heads, head_dim]."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown cache layout {layout!r}; choose from {LAYOUTS}")
    if layout == "nhd":
        return cache
    blocks, page, heads, dim = cache.shape
    out = torch.empty((blocks, heads, page, dim), dtype=cache.dtype, device=cache.device).permute(0, 2, 1, 3)
    out.copy_(cache)
    return out


class Setting:
    def __init__(self, prefix, distinct, group, dry: bool, device, dtype, num_sms: int, layouts):
        self.name = f"{prefix}/{distinct}/{group}"
        seqs = scenario_seqs(prefix, distinct, group, mixed=False, jitter=False)
        if dry:
            seqs = seqs[:4]
        self.b = make_batch(seqs, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                            block_size=BLOCK_SIZE, dtype=dtype, device=device)
        self.kv_bytes = kv_bytes_unique(seqs) * (4 if dtype == torch.float32 else 2) / 2
        self.ref = paged_attention_reference(self.b.query, self.b.k_cache, self.b.v_cache, self.b.query_start_loc,
                                             self.b.seq_lens, self.b.shared_kv_lens, self.b.block_tables,
                                             HEAD_DIM ** -0.5).float()
        self.caches = {layout: (as_layout(self.b.k_cache, layout), as_layout(self.b.v_cache, layout))
                       for layout in layouts}
        self.meta = self.b.metadata_numpy()
        self.num_sms = num_sms
        self.side_stream = torch.cuda.Stream() if device == "cuda" else None

    def device_plan(self, cand: Candidate):
        plan = build_prefix_shared_plan(**self.meta, block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                                        num_heads=NUM_HEADS, head_dim=HEAD_DIM, tile=cand.tile, num_sms=self.num_sms,
                                        programs_per_sm=cand.split_programs_per_sm)
        return graph_plan(plan, self.b.query.device, self.num_sms, split=True)

    def time(self, cand: Candidate, layout: str) -> tuple[float, float]:
        """(us, max abs error) of the engine's decode launches."""
        k, v = self.caches[layout]
        plan = self.device_plan(cand)
        side = self.side_stream if cand.overlap else None
        fn = lambda: prefix_shared_attention(self.b.query, k, v, plan, HEAD_DIM ** -0.5,  # noqa: E731
                                             side_stream=side)
        err = (fn().float() - self.ref).abs().max().item()
        return bench_us(fn), err

    def launches(self, cand: Candidate, layout: str, big_programs_per_sm: int | None = None,
                 small_programs_per_sm: int | None = None) -> dict:
        """name -> callable of the BIG launch alone, the SMALL launch alone, the merge alone and all
        three ("total", the BIG launch on the side stream when cand.overlap), each persistent launch
        on its own grid of programs per SM (None: the tile's graph_programs_per_sm, as the engine)."""
        k, v = self.caches[layout]
        plan = self.device_plan(cand)
        q = self.b.query
        out = torch.empty_like(q)
        slots = max(plan.num_partial_slots, 1)
        part_out = torch.empty((slots, NUM_HEADS, HEAD_DIM), dtype=torch.float32, device=q.device)
        part_lse = torch.zeros((slots, NUM_HEADS), dtype=torch.float32, device=q.device)
        scale = HEAD_DIM ** -0.5
        default = cand.tile.graph_programs_per_sm
        big_plan, small_plan = (dataclasses.replace(plan, persistent_programs=(per_sm or default) * self.num_sms)
                                for per_sm in (big_programs_per_sm, small_programs_per_sm))
        launches = {
            "big": lambda: _launch_items(plan.work_big, q, k, v, big_plan, out, part_out, part_lse, scale, 2,
                                         plan.num_items[0:1]),
            "small": lambda: _launch_items(plan.work_small, q, k, v, small_plan, out, part_out, part_lse, scale, 1,
                                           plan.num_items[1:2]),
            "merge": lambda: _merge(plan, out, part_out, part_lse),
        }
        side = self.side_stream if cand.overlap else None

        def total():
            if side is None:
                launches["big"]()
            else:
                current = torch.cuda.current_stream()
                side.wait_stream(current)
                with torch.cuda.stream(side):
                    launches["big"]()
            launches["small"]()
            if side is not None:
                current.wait_stream(side)
            launches["merge"]()
            return out

        launches["total"] = total
        return launches

    def breakdown(self, cand: Candidate, layout: str) -> dict:
        """us of the BIG launch alone, the SMALL launch alone and the merge alone."""
        launches = self.launches(cand, layout)
        return {name: round(bench_us(launches[name]), 2) for name in ("big", "small", "merge")}

    def grids(self, cand: Candidate, layout: str) -> list[dict]:
        """Rows of the persistent grids: the SMALL launch alone on each GRID_SMALL size, then the
        engine's launches with the BIG and SMALL grids of each pair of GRID_BIG x GRID_SMALL."""
        rows = []
        for small in GRID_SMALL:
            us = bench_us(self.launches(cand, layout, small_programs_per_sm=small)["small"])
            rows.append({"setting": self.name, "launch": "small", "big_programs_per_sm": None,
                         "small_programs_per_sm": small, "us": round(us, 2)})
        for big in GRID_BIG:
            for small in GRID_SMALL:
                total = self.launches(cand, layout, big, small)["total"]
                err = (total().float() - self.ref).abs().max().item()
                us = bench_us(total)
                rows.append({"setting": self.name, "launch": "total", "big_programs_per_sm": big,
                             "small_programs_per_sm": small, "us": round(us, 2),
                             "kv_tb_per_s": round(self.kv_bytes / us / 1e6, 3), "max_abs_err": err,
                             "valid": err < 5e-2})
        return rows


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values))


def write_grids(args, settings, start: Candidate, layout: str, device: str) -> int:
    t0 = time.time()
    rows = [row for s in settings for row in s.grids(start, layout)]
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
              "date": datetime.date.today().isoformat(), "git_commit": args.git_commit or git_commit(),
              "config": start.key(), "layout": layout, "engine_programs_per_sm": start.tile.graph_programs_per_sm,
              "rows": rows, "wall_s": round(time.time() - t0, 1)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    for row in rows:
        print(json.dumps(row))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/decode_tiles.json")
    parser.add_argument("--passes", type=int, default=2, help="coordinate-descent passes over SWEEP")
    parser.add_argument("--budget-s", type=float, default=400.0, help="stop searching after this many seconds")
    parser.add_argument("--fields", default=None, help="comma list of the SWEEP fields to search (default: all)")
    parser.add_argument("--layouts", default="nhd", help="comma list of cache layouts: nhd, hnd")
    parser.add_argument("--git-commit", default=None,
                        help="commit id to record (default: the checkout's short hash, with -dirty when "
                             "tracked files were changed)")
    parser.add_argument("--grids", action="store_true",
                        help="instead of the search: time the starting config's persistent launches on their own "
                             "grids (GRID_BIG x GRID_SMALL programs per SM; the first of --layouts)")
    parser.add_argument("--dry-run", action="store_true", help="tiny batches on CPU (run with TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cuda" and not args.dry_run:
        sys.exit("benchmarks/decode_tiles.py needs a CUDA device (or --dry-run)")
    layouts = args.layouts.split(",")
    if not set(layouts) <= set(LAYOUTS):
        sys.exit(f"unknown --layouts {sorted(set(layouts) - set(LAYOUTS))}; choose from {list(LAYOUTS)}")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    num_sms = device_num_sms(device, cpu_num_sms=4)
    settings = [Setting(p, d, g, args.dry_run, device, dtype, num_sms, layouts)
                for p, d, g in (DRY_SETTINGS if args.dry_run else SETTINGS)]
    start = Candidate(decode_tile_config(HEAD_DIM, NUM_HEADS // NUM_KV_HEADS))
    if args.grids:
        return write_grids(args, settings, start, layouts[0], device)
    serial = dataclasses.replace(start, overlap=False)
    sweep = {"overlap": (False, True), "small_n": (16,), "big_n": (16, 32)} \
        if args.dry_run else SWEEP
    if args.fields:
        unknown = set(args.fields.split(",")) - set(sweep)
        if unknown:
            sys.exit(f"unknown --fields {sorted(unknown)}; choose from {sorted(sweep)}")
        sweep = {field: sweep[field] for field in args.fields.split(",")}
    rows, notes, timed = [], [], {}
    t0 = time.time()

    def score(cand: Candidate, layout: str) -> float:
        """Geometric-mean us over the settings (inf when a setting is wrong or fails)."""
        key = (cand.key(), layout)
        if key not in timed:
            per = {}
            for s in settings:
                try:
                    us, err = s.time(cand, layout)
                except Exception as exc:  # noqa: BLE001 -- a config that fails to compile is a result too
                    notes.append(f"{layout} {cand.key()} {s.name}: {exc!r}"[:300])
                    per = None
                    break
                row = {"layout": layout, "config": cand.key(), "setting": s.name, "us": round(us, 2),
                       "kv_tb_per_s": round(s.kv_bytes / us / 1e6, 3), "max_abs_err": err, "valid": err < 5e-2}
                rows.append(row)
                print(json.dumps(row), flush=True)
                per[s.name] = us if row["valid"] else float("inf")
            timed[key] = geomean(per.values()) if per else float("inf")
        return timed[key]

    best = {}
    breakdown = {}
    for layout in layouts:
        breakdown[layout] = {s.name: s.breakdown(start, layout) for s in settings}
        score(serial, layout)
        current, current_us = start, score(start, layout)
        for _ in range(args.passes):
            for field, values in sweep.items():
                for value in values:
                    if time.time() - t0 > args.budget_s:
                        break
                    cand = current.with_field(field, value)
                    us = score(cand, layout)
                    if us < current_us * 0.995:
                        current, current_us = cand, us
        best[layout] = {"config": current.key(), "tile": vars(current.tile),
                        "split_programs_per_sm": current.split_programs_per_sm, "geomean_us": round(current_us, 2),
                        "per_setting": {r["setting"]: r["kv_tb_per_s"] for r in rows
                                        if r["layout"] == layout and r["config"] == current.key()}}
    if time.time() - t0 > args.budget_s:
        notes.append("--budget-s passed: the search stopped early")
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
              "date": datetime.date.today().isoformat(), "git_commit": args.git_commit or git_commit(),
              "start": start.key(), "start_geomean_us": {layout: round(timed[(start.key(), layout)], 2)
                                                         for layout in layouts},
              "serial_geomean_us": {layout: round(timed[(serial.key(), layout)], 2) for layout in layouts},
              "breakdown_us": breakdown, "best": best, "rows": rows, "notes": notes,
              "wall_s": round(time.time() - t0, 1)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    print(json.dumps({k: result[k] for k in ("start", "start_geomean_us", "serial_geomean_us", "breakdown_us", "best")},
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
