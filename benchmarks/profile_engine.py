"""Where a step's time goes: host phases per step, and GPU kernel totals by torch.profiler.

The profiled run also reports how busy the GPU was: the kernels' device time over the run's wall
time (gpu_idle_fraction: the host work not hidden behind the GPU; the profiler's own host
overhead counts as idle, so this is an upper bound).

    PYTHONPATH=. python3 benchmarks/profile_engine.py --model random:llama-3.1-8b \
        --workload micro:2000:200:16 --requests 256 --out profile.json

With --windows A:B,... the profile instead records those step windows of a second full run
(per policy of --policies), so steps deep inside a large batch can be looked at:

    PYTHONPATH=. python3 benchmarks/profile_engine.py --kv-cache-tokens 500000 --requests 1024 \
        --windows 60:64,280:284 --policies batchllm,vllm --out profile_windows.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

from batchllm.perf.runner import git_commit
from batchllm.perf.workload import make_workload


def steps_by_kind(steps) -> dict[str, list]:
    """A run's step records split into decode-only steps and steps with prefill chunks (a kind
    with no steps is left out)."""
    kinds = {"decode_only": [s for s in steps if s.num_distinct_tokens + s.num_prefix_tokens == 0],
             "with_prefill": [s for s in steps if s.num_distinct_tokens + s.num_prefix_tokens > 0]}
    return {name: group for name, group in kinds.items() if group}


def mean_ms(steps, attr: str) -> float:
    """The mean of a seconds field of step records, in ms."""
    return round(1000 * sum(getattr(s, attr) for s in steps) / len(steps), 2)


def _phase_summary(steps) -> dict:
    def total(attr):
        return round(sum(getattr(s, attr) for s in steps), 3)

    out = {"steps": len(steps), "wall_s": total("step_time_s"), "schedule_s": total("schedule_time_s"),
           "launch_s": total("launch_time_s"), "wait_s": total("wait_time_s")}
    for name, group in steps_by_kind(steps).items():
        n = len(group)
        out[name] = {
            "steps": n,
            "mean_tokens": round(sum(s.num_tokens for s in group) / n, 1),
            "mean_step_ms": mean_ms(group, "step_time_s"),
            "mean_schedule_ms": mean_ms(group, "schedule_time_s"),
            "mean_launch_ms": mean_ms(group, "launch_time_s"),
            "mean_wait_ms": mean_ms(group, "wait_time_s"),
            "mean_running_requests": round(sum(s.num_running_requests for s in group) / n, 1),
        }
    return out


CATEGORIES = (  # (category, substrings of kernel names), first match wins
    # the fused work-list launch, its merge, and the dense calls' cuDNN kernels (whose names
    # also hold "sm90", so they must match before the GEMMs)
    ("attention", ("work_list_attention", "merge_partials", "sdpa", "fmha", "cudnn")),
    # the dense calls' KV block gathers (index_select runs as vectorized_gather_kernel)
    ("attention_gather", ("indexselect", "index_select", "vectorized_gather")),
    ("kv_store", ("store_kv", "kv_store")),
    ("gemm", ("gemm", "cutlass", "xmma", "sm90", "cublas", "matmul", "nvjet")),
    ("norm_rope_silu", ("rms", "rope", "silu", "quantize_rows")),
    ("sampling", ("argmax", "softmax", "topk", "sort", "log_softmax")),
)


def _category(kernel_name: str) -> str:
    lowered = kernel_name.lower()
    return next((c for c, keys in CATEGORIES if any(k in lowered for k in keys)), "other")


def _kernel_ms(prof) -> dict[str, float]:
    """Device ms by kernel name (the profiler's own ProfilerStep ranges left out)."""
    from torch.autograd import DeviceType

    by_kernel: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type != DeviceType.CUDA or event.key.startswith("ProfilerStep"):
            continue
        device_us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        by_kernel[event.key[:90]] = by_kernel.get(event.key[:90], 0.0) + device_us / 1000.0
    return by_kernel


def _categories(prof) -> dict:
    """GPU kernel time by category (ms): where the device time of the profiled run goes."""
    totals: dict[str, float] = {}
    try:
        for name, ms in _kernel_ms(prof).items():
            totals[_category(name)] = totals.get(_category(name), 0.0) + ms
    except Exception as error:  # the profile table above is still printed and saved
        return {"error": repr(error)}
    return {k: round(v, 2) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def _sync(torch) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _window_summary(by_kernel: dict[str, float], records, first: int, end: int, wall_s: float) -> dict:
    """GPU kernel time per step in one window, by category and by top kernels."""
    num_steps = end - first
    categories: dict[str, float] = {}
    for name, ms in by_kernel.items():
        categories[_category(name)] = categories.get(_category(name), 0.0) + ms
    steps = [r for r in records if first <= r.step_index < end]
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:14]
    return {
        "steps": [first, end],
        "mean_tokens": round(sum(r.num_tokens for r in steps) / max(1, len(steps)), 1),
        "mean_decode_rows": round(sum(r.num_decode_tokens for r in steps) / max(1, len(steps)), 1),
        "mean_running": round(sum(r.num_running_requests for r in steps) / max(1, len(steps)), 1),
        "wall_ms_per_step": round(1000 * wall_s / num_steps, 2),
        "gpu_ms_per_step": round(sum(categories.values()) / num_steps, 2),
        "category_ms_per_step": {k: round(v / num_steps, 3) for k, v in sorted(categories.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms_per_step": [[k, round(v / num_steps, 3)] for k, v in top],
    }


def _profile_windows(llm, prompts, params, windows) -> list[dict]:
    """One full run with torch.profiler recording only the given step windows (GPU kernels,
    graph replays included). Async scheduling makes a window's edges fuzzy by one step: a
    window can hold the kernels of one step more than it counts (BENCHMARKS.md)."""
    import torch
    from torch.profiler import ProfilerAction, ProfilerActivity, profile

    from batchllm.engine.llm_engine import PreparedRequest, RunStats

    def action(step: int):
        for first, end in windows:
            if step == first - 1:
                return ProfilerAction.WARMUP
            if first <= step < end - 1:
                return ProfilerAction.RECORD
            if step == end - 1:
                return ProfilerAction.RECORD_AND_SAVE
        return ProfilerAction.NONE

    marks: dict[int, float] = {}
    stats = RunStats()
    summaries: list[dict[str, float]] = []
    requests = [PreparedRequest(i, list(p), q) for i, (p, q) in enumerate(zip(prompts, params))]
    step = {"n": 0}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], schedule=action,
                 on_trace_ready=lambda p: summaries.append(_kernel_ms(p))) as prof:
        def on_step(num_finished, num_new):
            marks[step["n"]] = time.perf_counter()
            step["n"] += 1
            prof.step()
        for _ in llm.engine.run(requests, on_step=on_step, stats=stats):
            pass
        _sync(torch)
    out = []
    for (first, end), trace in zip(windows, summaries):
        wall = marks.get(end - 1, 0.0) - marks.get(first - 1, 0.0)
        out.append(_window_summary(trace, stats.step_records, first, end, wall))
    return out


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine and workload of a profiled run (shared with host_profile.py)."""
    parser.add_argument("--model", default="random:llama-3.1-8b")
    parser.add_argument("--workload", default="micro:2000:200:16")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=100)
    parser.add_argument("--policy", default="batchllm")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-tokens", type=int, default=None)
    parser.add_argument("--quantization", default=None, choices=["fp8"], help="FP8 linear layers")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--git-commit", default=None,
                        help="commit recorded in the result (default: this checkout's, -dirty with changes)")


def make_engine_and_requests(args):
    """(LLM, prompts, sampling params) of the run that add_engine_arguments describes; every request
    runs to its workload's output length."""
    from batchllm import LLM, SamplingParams

    llm = LLM(model=args.model, policy=args.policy, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_tokens=args.kv_cache_tokens, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype)
    workload = make_workload(args.workload, args.requests, args.output_tokens, llm.engine.arch.vocab_size, 0)
    prompts = [p.tolist() for p in workload.prompts]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in workload.max_tokens]
    return llm, prompts, params


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(parser)
    parser.add_argument("--profile-requests", type=int, default=64, help="requests in the torch.profiler run")
    parser.add_argument("--out", default="profile.json")
    parser.add_argument("--windows", default="",
                        help="profile step windows of a second full run instead of a run of the first "
                             "--profile-requests requests, e.g. '40:44,150:154,260:264' (step indices, end excluded)")
    parser.add_argument("--policies", default="", help="comma list: repeat the windowed profile for each policy")
    args = parser.parse_args()

    import torch

    llm, prompts, params = make_engine_and_requests(args)
    llm.generate(prompts[:8], params[:8], use_tqdm=False)  # compile
    _sync(torch)
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    _sync(torch)
    result = {"git_commit": args.git_commit or git_commit(), "date": datetime.date.today().isoformat(),
              "model": args.model, "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
              "workload": args.workload, "requests": len(prompts), "policy": args.policy,
              "seconds": round(time.perf_counter() - started, 3),
              "phases": _phase_summary(llm.last_run_stats.step_records)}
    graphs = llm.engine.runner.graphs
    if graphs is not None:
        result["graphs"] = {"captured": len(graphs.graphs), "replays": graphs.num_replays}
    print(json.dumps(result, indent=1), flush=True)

    if args.windows:
        windows = [tuple(int(x) for x in w.split(":")) for w in args.windows.split(",")]
        result["windows"] = {}
        for policy in (args.policies.split(",") if args.policies else [args.policy]):
            if policy != args.policy:
                llm.engine.configure_scheduler(policy=policy)
            result["windows"][policy] = _profile_windows(llm, prompts, params, windows)
            print(json.dumps(result["windows"][policy], indent=1), flush=True)
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)
        return 0

    from torch.profiler import ProfilerActivity, profile

    count = args.profile_requests
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        llm.generate(prompts[:count], params[:count], use_tqdm=False)
        _sync(torch)
        wall_ms = 1000 * (time.perf_counter() - started)
    busy_ms = sum(_kernel_ms(prof).values())
    result["profiled_run"] = {"wall_ms": round(wall_ms, 1), "gpu_busy_ms": round(busy_ms, 1),
                              "gpu_idle_fraction": round(max(wall_ms - busy_ms, 0.0) / wall_ms, 4)}
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
    print(table)
    kernels = []
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if device_us:
            kernels.append({"name": event.key[:120], "calls": event.count, "device_ms": round(device_us / 1000, 3)})
    kernels.sort(key=lambda k: -k["device_ms"])
    result["kernel_categories_ms"] = _categories(prof)
    print(json.dumps(result["kernel_categories_ms"], indent=1), flush=True)
    result["profile_requests"] = count
    result["kernels"] = kernels[:40]
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
