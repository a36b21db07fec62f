"""Where the host's launch time goes: the runner's `execute` (build a step's inputs, launch its
forward or replay its graph, launch the sampler) under cProfile, its host seconds grouped by
where the code lives, separately for eager steps (those with prefill chunks, or too large for a
graph) and for steps replayed from a CUDA graph.

One run warms the engine up (CUDA-graph captures, kernel compiles), one plain run gives the launch
ms per step as `batchllm bench` reports it, and one run under cProfile attributes it. cProfile
costs time for every Python call it sees, so the profiled launch is longer than the plain one:
read the categories as shares of the profiled launch.

    PYTHONPATH=. python3 benchmarks/host_profile.py --kv-cache-tokens 500000 --requests 256 \
        --quantization fp8 --out host_profile.json
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from profile_engine import add_engine_arguments, make_engine_and_requests, mean_ms, steps_by_kind

from batchllm.perf.runner import git_commit

# (category, test on (file name, function name)), first match wins. Built-in functions have the
# file name "~" and a name such as "<method 'copy_' of 'torch._C.TensorBase' objects>".
CATEGORIES = (
    ("gpu_wait", lambda path, name: path == "~" and ("synchronize" in name or "'item'" in name)),
    ("triton_launcher", lambda path, name: "/triton/" in path or "cuda_utils" in path or "__triton_launcher" in path),
    ("torch_builtin_ops", lambda path, name: path == "~" and "torch" in name),
    ("torch_python", lambda path, name: "/torch/" in path),
    ("attention_plan", lambda path, name: "batchllm/attention_plan/" in path),
    ("batchllm_ops", lambda path, name: "batchllm/ops/" in path),
    ("batchllm_models", lambda path, name: "batchllm/models/" in path),
    ("batchllm_engine", lambda path, name: "batchllm/engine/" in path),
    ("numpy", lambda path, name: "numpy" in path or (path == "~" and "numpy" in name)),
    ("python_builtins", lambda path, name: path == "~"),
)


def category(path: str, name: str) -> str:
    return next((c for c, test in CATEGORIES if test(path.replace("\\", "/"), name)), "other")


def summarize(stats: pstats.Stats, num_steps: int, top: int = 25) -> dict:
    """Host ms per step by category (each function's own time, callees excluded), and the
    functions with the most own time."""
    by_category: dict[str, float] = {}
    functions = []
    for (path, line, name), (_, num_calls, own_s, cumulative_s, _) in stats.stats.items():
        group = category(path, name)
        by_category[group] = by_category.get(group, 0.0) + own_s
        functions.append((own_s, num_calls, cumulative_s, f"{path}:{line}({name})", group))
    functions.sort(reverse=True)
    steps = max(num_steps, 1)
    return {
        "profiled_ms_per_step": round(1000 * sum(by_category.values()) / steps, 2),
        "category_ms_per_step": {k: round(1000 * v / steps, 2) for k, v in
                                 sorted(by_category.items(), key=lambda kv: -kv[1])},
        "top_functions": [{"function": where[-160:], "category": group, "calls_per_step": round(calls / steps, 1),
                           "own_ms_per_step": round(1000 * own / steps, 3),
                           "cumulative_ms_per_step": round(1000 * cumulative / steps, 3)}
                          for own, calls, cumulative, where, group in functions[:top]],
    }


def _launch_summary(records) -> dict:
    """Launch, GPU wait and step ms per step, over all steps and by kind of step."""
    return {name: {"steps": len(group), "launch_ms_per_step": mean_ms(group, "launch_time_s"),
                   "wait_ms_per_step": mean_ms(group, "wait_time_s"), "step_ms": mean_ms(group, "step_time_s")}
            for name, group in {"all": records, **steps_by_kind(records)}.items() if group}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(parser)
    parser.add_argument("--top", type=int, default=25, help="functions listed by own time")
    parser.add_argument("--out", default="host_profile.json")
    args = parser.parse_args()

    import torch

    llm, prompts, params = make_engine_and_requests(args)

    def run() -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - started

    run()  # warm: graph captures and compiles
    plain_s = run()
    plain = _launch_summary(llm.last_run_stats.step_records)

    runner = llm.engine.runner
    execute = runner.execute
    profiles: dict[str, pstats.Stats] = {}
    calls = {"eager": 0, "graph_replay": 0}

    def profiled_execute(*call_args, **call_kwargs):
        replays = runner.graphs.num_replays if runner.graphs is not None else 0
        profiler = cProfile.Profile()
        profiler.enable()
        try:
            return execute(*call_args, **call_kwargs)
        finally:
            profiler.disable()
            replayed = runner.graphs is not None and runner.graphs.num_replays > replays
            kind = "graph_replay" if replayed else "eager"
            calls[kind] += 1
            if kind in profiles:
                profiles[kind].add(profiler)
            else:
                profiles[kind] = pstats.Stats(profiler)

    runner.execute = profiled_execute
    try:
        profiled_s = run()
    finally:
        runner.execute = execute
    records = llm.last_run_stats.step_records
    result = {"git_commit": args.git_commit or git_commit(), "date": datetime.date.today().isoformat(),
              "model": args.model, "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
              "workload": args.workload,
              "requests": len(prompts), "policy": args.policy,
              "plain_run": {"seconds": round(plain_s, 3), **plain},
              "profiled_run": {"seconds": round(profiled_s, 3), **_launch_summary(records)},
              "execute_profile": {kind: {"steps": calls[kind], **summarize(stats, calls[kind], args.top)}
                                  for kind, stats in profiles.items()}}
    print(json.dumps(result, indent=1), flush=True)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
