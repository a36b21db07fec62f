"""Prefix planner benchmark: planning time, peak RSS, saving ratios.

    python benchmarks/planner.py                  # every case, each in its own process
    python benchmarks/planner.py --case industrial-8000

Cases:
  industrial-8000  the industrial-like set of 8000 requests (BatchLLM 6.2.2); target <= 0.5 s
  micro            the paper's micro sets: saving ratios vs the (sd-1)P/(sd(P+D)) upper bound
  million          1M requests of ~300 tokens (prefix ~270, distinct ~30, sd ~3); target
                   <= 60 s and <= 4 GB peak RSS (resource.getrusage, whole process)
Peak RSS includes the generated prompts themselves (1M x 300 int32 = 1.2 GB).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from batchllm.prefix import plan_prefix_arrays, plan_prefix_groups
from batchllm.perf.workloads import industrial_workload, micro_workload

MICRO_SETS = [(2000, 200, 4), (2000, 200, 16), (2000, 1000, 4), (2000, 1000, 16),
              (1000, 1000, 4), (1000, 1000, 16), (16000, 200, 16)]


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _ratios(stats) -> dict:
    return {
        "saving_ratio_optimal": round(stats.saving_ratio, 4),
        "saving_ratio_multi_level": round(stats.saving_ratio_multi_level, 4),
        "saving_ratio_naive_first_level": round(stats.saving_ratio_naive_first_level, 4),
    }


def bench_industrial(num_requests: int, repeats: int) -> dict:
    workload = industrial_workload(num_requests=num_requests, seed=0)
    prompts = list(workload.prompts)
    lists = [p.tolist() for p in prompts]
    timings = {"arrays": [], "groups": [], "groups_from_lists": []}
    for _ in range(repeats):
        for key, function, data in (("arrays", plan_prefix_arrays, prompts),
                                    ("groups", plan_prefix_groups, prompts),
                                    ("groups_from_lists", plan_prefix_groups, lists)):
            started = time.perf_counter()
            plan = function(data)
            timings[key].append(time.perf_counter() - started)
    stats = plan.stats
    return {
        "case": f"industrial-{num_requests}",
        "prompt_tokens_mean": round(workload.num_prompt_tokens / num_requests, 1),
        "seconds_plan_arrays_best": round(min(timings["arrays"]), 3),
        "seconds_plan_groups_best": round(min(timings["groups"]), 3),
        "seconds_plan_groups_from_lists_best": round(min(timings["groups_from_lists"]), 3),
        **_ratios(stats),
        "groups": stats.num_groups,
        "shared_groups": stats.num_shared_groups,
        "sharing_degree_mean_shared": round(stats.sharing_degree.mean, 2),
        "prefix_tokens_mean_shared": round(stats.prefix_num_tokens.mean, 1),
        "peak_rss_mib": round(_peak_rss_mib()),
    }


def bench_micro(num_requests: int) -> list[dict]:
    rows = []
    for prefix, distinct, degree in MICRO_SETS:
        workload = micro_workload(prefix, distinct, degree, num_requests=num_requests, seed=0)
        stats = plan_prefix_arrays(list(workload.prompts)).stats
        rows.append({
            "case": f"micro {prefix}/{distinct} sd{degree}",
            "requests": num_requests,
            **_ratios(stats),
            "upper_bound": round((degree - 1) * prefix / (degree * (prefix + distinct)), 4),
            "seconds": round(stats.planning_seconds, 3),
        })
    return rows


def bench_million(num_requests: int, with_groups: bool) -> dict:
    started = time.perf_counter()
    workload = industrial_workload(num_requests=num_requests, mean_prefix_num_tokens=270,
                                   mean_distinct_num_tokens=30, instruction_num_tokens=16,
                                   num_instruction_templates=8, seed=0)
    prompts = list(workload.prompts)
    generate_seconds = time.perf_counter() - started
    rss_after_generate = _peak_rss_mib()
    del workload
    started = time.perf_counter()
    plan = plan_prefix_groups(prompts) if with_groups else plan_prefix_arrays(prompts)
    plan_seconds = time.perf_counter() - started
    stats = plan.stats
    return {
        "case": f"million-{num_requests}" + ("-groups" if with_groups else "-arrays"),
        "prompt_tokens_mean": round(stats.logical_prefill_tokens / num_requests, 1),
        "seconds_generate": round(generate_seconds, 1),
        "seconds_plan": round(plan_seconds, 1),
        "peak_rss_mib_after_generate": round(rss_after_generate),
        "peak_rss_mib": round(_peak_rss_mib()),
        **_ratios(stats),
        "groups": stats.num_groups,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=["all", "industrial-8000", "micro", "million", "million-groups"],
                        default="all")
    args = parser.parse_args(argv)
    if args.case == "all":  # one process per case: peak RSS is per case
        for case in ("industrial-8000", "micro", "million", "million-groups"):
            subprocess.run([sys.executable, __file__, "--case", case], check=True)
        return 0
    if args.case == "industrial-8000":
        results = [bench_industrial(8000, repeats=5)]
    elif args.case == "micro":
        results = bench_micro(6400)
    else:
        results = [bench_million(1_000_000, with_groups=args.case == "million-groups")]
    for row in results:
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
