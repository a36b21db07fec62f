"""Scheduler simulation table for the paper's workloads: batchllm vs vllm vs sglang.

    python benchmarks/simulate_policies.py [--num-requests 6400] [--kv-cache-tokens 430000]
        [--max-num-batched-tokens 2048] [--markdown OUT.md]

No model, no GPU: each policy is driven by the simulator's fake sampling (every request
runs to its max_tokens = 100) and linear cost model (batchllm/sched/simulator.py). The KV
cache default, 430k tokens, is Llama-3.1-8B (128 KiB/token) on an 80 GB GPU after weights,
the paper's A100 setting (BatchLLM 6.3.1). vllm runs with its defaults (max_num_seqs 256).
"""

from __future__ import annotations

import argparse
import sys
import time

from batchllm.sched.config import SchedulerConfig
from batchllm.sched.simulator import SimRequest, simulate
from batchllm.perf.workloads import industrial_workload, micro_workload

POLICIES = ("batchllm", "vllm", "sglang")
MICRO = ((2000, 200, 4), (2000, 200, 16), (2000, 1000, 4), (2000, 1000, 16), (1000, 1000, 4), (1000, 1000, 16))


def _requests(workload) -> list[SimRequest]:
    return [SimRequest(tuple(p.tolist()), int(m)) for p, m in zip(workload.prompts, workload.max_tokens)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=6400, help="micro sets (paper Fig. 6: 6400)")
    parser.add_argument("--industrial-requests", type=int, default=8000, help="industrial-like (paper 6.2.2: 8000)")
    parser.add_argument("--kv-cache-tokens", type=int, default=430_000)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)

    workloads = [micro_workload(p, d, sd, num_requests=args.num_requests) for p, d, sd in MICRO]
    workloads.append(industrial_workload(num_requests=args.industrial_requests))
    header = ("| workload | policy | steps | mean tokens/step | valleys (<N/2) | saving ratio | "
              "peak KV tokens | preemptions | est. time (s) |")
    lines = [header, "|" + "---|" * 9]
    for workload in workloads:
        requests = _requests(workload)
        for policy in POLICIES:
            config = SchedulerConfig(policy=policy, num_kv_blocks=args.kv_cache_tokens // 16, block_size=16,
                                     max_num_batched_tokens=args.max_num_batched_tokens)
            started = time.perf_counter()
            result, _, _ = simulate(requests, config)
            lines.append(
                f"| {workload.name} | {policy} | {result.steps} | {result.mean_tokens_per_step:.0f} | "
                f"{result.valley_steps} | {100 * result.saving_ratio:.1f}% | {result.peak_kv_tokens} | "
                f"{result.preemptions} | {result.estimated_time_s:.1f} |"
            )
            print(lines[-1], f"({time.perf_counter() - started:.0f} s wall)", file=sys.stderr, flush=True)
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as file:
            file.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
