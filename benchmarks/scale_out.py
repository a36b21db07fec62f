"""Planning for internet scale: planner cost vs requests, windowed vs global planning,
and the data-parallel plan's balance and sharing.

    python benchmarks/scale_out.py replicas            # industrial-like 8000: 2, 8, 64 replicas
    python benchmarks/scale_out.py windows             # sharing kept by windowed planning
    python benchmarks/scale_out.py scale --requests 10000,100000,1000000,3000000   # one process each
Torch-free. Prints JSON lines; --out appends them to a file.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import numpy as np

from batchllm.distributed.dp_plan import plan_replicas
from batchllm.prefix.planner import plan_prefix_arrays
from batchllm.perf.workloads import industrial_workload

SCALE_PREFIX_TOKENS = 270.0  # the planner benchmark's 1M shape (~300 tokens a request), to fit in RAM


def emit(record: dict, out: str | None) -> None:
    print(json.dumps(record), flush=True)
    if out:
        with open(out, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")


def saved_by_random_split(prompts, num_replicas: int, seed: int = 0) -> int:
    """Requests dealt to replicas at random, each replica plans its own share (what a
    prefix-blind data-parallel split keeps)."""
    replica = np.random.default_rng(seed).integers(num_replicas, size=len(prompts))
    total = 0
    for r in range(num_replicas):
        share = [prompts[i] for i in np.flatnonzero(replica == r).tolist()]
        if share:
            total += plan_prefix_arrays(share).stats.saved_prefill_tokens
    return total


def replicas(args) -> None:
    workload = industrial_workload(num_requests=args.num_requests)
    for num_replicas in (2, 8, 64):
        for split in (True, False):
            started = time.perf_counter()
            plan = plan_replicas(workload.prompts, workload.max_tokens, num_replicas, split_oversized_groups=split)
            seconds = time.perf_counter() - started
            emit({"what": "dp_plan", "workload": workload.name, "requests": workload.num_requests,
                  "replicas": num_replicas, "split_oversized_groups": split, "balance_max_over_mean": round(plan.balance, 4),
                  "sharing_kept": round(plan.sharing_kept, 6), "global_saving_ratio": round(plan.plan.stats.saving_ratio, 4),
                  "units": int(plan.unit_replica.size), "seconds": round(seconds, 3)}, args.out)
        kept_random = saved_by_random_split(workload.prompts, num_replicas) / plan.saved_tokens_global
        emit({"what": "dp_random_split", "replicas": num_replicas, "sharing_kept": round(kept_random, 4)}, args.out)


def windows(args) -> None:
    for num_requests, mean_prefix, window_sizes in ((8000, 1570.0, (500, 1000, 2000, 4000)),
                                                    (1_000_000, SCALE_PREFIX_TOKENS, (10_000, 100_000))):
        workload = industrial_workload(num_requests=num_requests, mean_prefix_num_tokens=mean_prefix)
        global_saved = plan_prefix_arrays(workload.prompts).stats.saved_prefill_tokens
        for window in window_sizes:
            saved = sum(plan_prefix_arrays(workload.prompts[start:start + window]).stats.saved_prefill_tokens
                        for start in range(0, num_requests, window))
            emit({"what": "windowed_planning", "requests": num_requests, "window": window,
                  "sharing_kept": round(saved / global_saved, 4)}, args.out)


def scale_one(num_requests: int, num_replicas: int) -> dict:
    started = time.perf_counter()
    workload = industrial_workload(num_requests=num_requests, mean_prefix_num_tokens=SCALE_PREFIX_TOKENS)
    generate_s = time.perf_counter() - started
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    started = time.perf_counter()
    plan = plan_prefix_arrays(workload.prompts)
    plan_s = time.perf_counter() - started
    started = time.perf_counter()
    replica_plan = plan_replicas(workload.prompts, workload.max_tokens, num_replicas, plan=plan)
    assign_s = time.perf_counter() - started
    return {"what": "planner_scale", "requests": num_requests, "prompt_tokens": workload.num_prompt_tokens,
            "generate_s": round(generate_s, 1), "plan_s": round(plan_s, 2), "assign_s": round(assign_s, 2),
            "rss_after_generate_mib": round(rss_before), "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "saving_ratio": round(plan.stats.saving_ratio, 4), "groups": plan.stats.num_groups,
            "replicas": num_replicas, "balance": round(replica_plan.balance, 4),
            "sharing_kept": round(replica_plan.sharing_kept, 6)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["replicas", "windows", "scale", "scale-one"])
    parser.add_argument("--num-requests", type=int, default=8000)
    parser.add_argument("--requests", default="10000,100000,1000000")
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.mode == "replicas":
        replicas(args)
    elif args.mode == "windows":
        windows(args)
    elif args.mode == "scale-one":
        emit(scale_one(args.num_requests, args.replicas), args.out)
    else:  # one process per size: peak RSS is per size
        for n in args.requests.split(","):
            command = [sys.executable, __file__, "scale-one", "--num-requests", n, "--replicas", str(args.replicas)]
            if args.out:
                command += ["--out", args.out]
            subprocess.run(command, check=True)


if __name__ == "__main__":
    main()
