r"""Where a step's time goes, on the GPU (`gpu`) or on the host (`host`).

gpu: an untimed run of the whole workload (CUDA-graph captures and kernel compiles, which follow
its shapes), a timed run (host phases per step, by kind of step), then a third run with
torch.profiler recording the step windows of --windows: GPU kernel time per step, by category and
by kernel. Asynchronous scheduling makes a window's edges fuzzy by one step: a window can hold the
kernels of one step more than it counts.

    PYTHONPATH=. python3 benchmarks/profile_engine.py gpu --kv-cache-tokens 500000 --requests 1024 \
        --windows 40:44,100:104,150:154,230:234 --out profile_windows.json

host: a warm run (CUDA-graph captures, kernel compiles), a plain run (launch ms per step as
`batchllm bench` reports it, by kind of step), then a run with a HostProfiler as the runner's step
observer: cProfile around each step's launch, its host seconds by where the code lives, for eager
steps and for graph replays (batchllm/perf/host_profile.py).

    PYTHONPATH=. python3 benchmarks/profile_engine.py host --kv-cache-tokens 500000 --requests 256 \
        --quantization fp8 --out host_profile.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

from batchllm.config import ATTENTION_BACKENDS
from batchllm.perf.runner import git_commit
from batchllm.perf.workload import make_workload
from batchllm.sched.config import DEFAULT_MAX_NUM_BATCHED_TOKENS

CATEGORIES = (  # (category, substrings of kernel names), first match wins
    # the fused work-list launch, its merge, and the dense calls' cuDNN kernels (whose names
    # also hold "sm90", so they must match before the GEMMs)
    ("attention", ("work_list_attention", "merge_partials", "sdpa", "fmha", "cudnn")),
    # FlashInfer's FA3 prompt attention and TensorRT-LLM's XQA decode kernel (backend xqa)
    ("fa3", ("prefillwithkvcache",)),
    ("xqa", ("kernel_mha",)),
    # the dense calls' KV block gathers (index_select runs as vectorized_gather_kernel)
    ("attention_gather", ("indexselect", "index_select", "vectorized_gather")),
    ("kv_store", ("store_kv", "kv_store")),
    ("gemm", ("gemm", "cutlass", "xmma", "sm90", "cublas", "matmul", "nvjet")),
    ("norm_rope_silu", ("rms", "rope", "silu", "quantize", "amax")),  # and FP8 quantization
    ("sampling", ("argmax", "softmax", "topk", "sort", "log_softmax")),
)


def kernel_category(kernel_name: str) -> str:
    lowered = kernel_name.lower()
    return next((c for c, keys in CATEGORIES if any(k in lowered for k in keys)), "other")


def steps_by_kind(steps) -> dict[str, list]:
    """A run's step records split into decode-only steps and steps with prefill chunks (a kind
    with no steps is left out)."""
    kinds = {"decode_only": [s for s in steps if s.num_distinct_tokens + s.num_prefix_tokens == 0],
             "with_prefill": [s for s in steps if s.num_distinct_tokens + s.num_prefix_tokens > 0]}
    return {name: group for name, group in kinds.items() if group}


def mean_ms(steps, attr: str) -> float:
    """The mean of a seconds field of step records, in ms."""
    return round(1000 * sum(getattr(s, attr) for s in steps) / len(steps), 2)


def launch_summary(records) -> dict:
    """Launch, GPU wait and step ms per step, over all steps and by kind of step."""
    return {name: {"steps": len(group), "launch_ms_per_step": mean_ms(group, "launch_time_s"),
                   "wait_ms_per_step": mean_ms(group, "wait_time_s"), "step_ms": mean_ms(group, "step_time_s")}
            for name, group in {"all": records, **steps_by_kind(records)}.items() if group}


def _kernel_ms(prof) -> dict[str, float]:
    """Device ms by kernel name (the profiler's own ProfilerStep ranges left out)."""
    from torch.autograd import DeviceType

    by_kernel: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type != DeviceType.CUDA or event.key.startswith("ProfilerStep"):
            continue
        by_kernel[event.key[:90]] = by_kernel.get(event.key[:90], 0.0) + event.self_device_time_total / 1000.0
    return by_kernel


def _window_summary(by_kernel: dict[str, float], records, first: int, end: int, wall_s: float) -> dict:
    """GPU kernel time per step in one window, by category and by top kernels."""
    num_steps = end - first
    categories: dict[str, float] = {}
    for name, ms in by_kernel.items():
        categories[kernel_category(name)] = categories.get(kernel_category(name), 0.0) + ms
    steps = [r for r in records if first <= r.step_index < end]

    def mean(attr: str) -> float:
        return round(sum(getattr(r, attr) for r in steps) / max(1, len(steps)), 1)

    return {
        "steps": [first, end], "mean_tokens": mean("num_tokens"), "mean_decode_rows": mean("num_decode_tokens"),
        "mean_running": mean("num_running_requests"), "wall_ms_per_step": round(1000 * wall_s / num_steps, 2),
        "gpu_ms_per_step": round(sum(categories.values()) / num_steps, 2),
        "category_ms_per_step": {k: round(v / num_steps, 3) for k, v in sorted(categories.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms_per_step": [[k, round(v / num_steps, 3)]
                                    for k, v in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:14]],
    }


def profile_windows(llm, prompts, params, windows) -> list[dict]:
    """One full run with torch.profiler recording only the given step windows (GPU kernels,
    graph replays included)."""
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

    marks: list[float] = []
    stats = RunStats()
    traces: list[dict[str, float]] = []
    requests = [PreparedRequest(i, list(p), q) for i, (p, q) in enumerate(zip(prompts, params))]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], schedule=action,
                 on_trace_ready=lambda p: traces.append(_kernel_ms(p))) as prof:
        def on_step(num_finished, num_new):
            marks.append(time.perf_counter())
            prof.step()
        for _ in llm.engine.run(requests, on_step=on_step, stats=stats):
            pass
        _sync()
    unreached = [f"{first}:{end}" for first, end in windows if end > len(marks)]
    if unreached:  # a larger token budget runs the same work in fewer steps
        print(f"profile: the run took {len(marks)} steps; windows {', '.join(unreached)} were not profiled "
              "(pass --windows inside the run)", file=sys.stderr)
    return [_window_summary(trace, stats.step_records, first, end, marks[end - 1] - marks[first - 1])
            for (first, end), trace in zip(windows, traces)]


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed_run(llm, prompts, params) -> float:
    _sync()
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    _sync()
    return round(time.perf_counter() - started, 3)


def _warm(llm, prompts, params) -> None:
    """One untimed run of the whole workload: its CUDA-graph captures and kernel compiles follow
    its shapes (decode graphs per rows bucket and block-table width). After a warm-up on 8 of its
    1,024 requests, micro 2000/200 sd16's timed run took 20.1 s in FP8, where `batchllm bench`
    after its warm pass takes 8.5 s."""
    llm.generate(prompts, params, use_tqdm=False)


def run_gpu(args, llm, prompts, params, result: dict) -> None:
    _warm(llm, prompts, params)
    result["seconds"] = _timed_run(llm, prompts, params)
    result["phases"] = launch_summary(llm.last_run_stats.step_records)
    windows = [tuple(int(x) for x in w.split(":")) for w in args.windows.split(",")]
    result["windows"] = profile_windows(llm, prompts, params, windows)


def run_host(args, llm, prompts, params, result: dict) -> None:
    from batchllm.perf.host_profile import HostProfiler

    _warm(llm, prompts, params)
    result["plain_run"] = {"seconds": _timed_run(llm, prompts, params),
                           **launch_summary(llm.last_run_stats.step_records)}
    profiler = HostProfiler()
    llm.engine.runner.observer = profiler
    try:
        seconds = _timed_run(llm, prompts, params)
    finally:
        llm.engine.runner.observer = None
    result["profiled_run"] = {"seconds": seconds, **launch_summary(llm.last_run_stats.step_records)}
    result["execute_profile"] = profiler.summary(args.top)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["gpu", "host"])
    parser.add_argument("--model", default="random:llama-3.1-8b")
    parser.add_argument("--workload", default="micro:2000:200:16")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=100)
    parser.add_argument("--policy", default="batchllm")
    parser.add_argument("--kv-cache-tokens", type=int, default=None)
    parser.add_argument("--quantization", default=None, choices=["fp8"], help="FP8 linear layers")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="fp8: an FP8 KV cache")
    parser.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                        help="the token budget per step")
    parser.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                        help="xqa: decode rows that share no KV attend by FlashInfer's XQA kernel")
    parser.add_argument("--windows", default="40:44,100:104,150:154,230:234",
                        help="gpu: step windows to profile (step indices, end excluded)")
    parser.add_argument("--top", type=int, default=25, help="host: functions listed by own time")
    parser.add_argument("--out", default="profile.json")
    args = parser.parse_args(argv)

    from batchllm import LLM, SamplingParams

    llm = LLM(model=args.model, policy=args.policy, kv_cache_tokens=args.kv_cache_tokens,
              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
              max_num_batched_tokens=args.max_num_batched_tokens, attention_backend=args.attention_backend)
    workload = make_workload(args.workload, args.requests, args.output_tokens, llm.engine.arch.vocab_size, 0)
    prompts = [p.tolist() for p in workload.prompts]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in workload.max_tokens]
    result = {"git_commit": git_commit(), "date": datetime.date.today().isoformat(), "model": args.model,
              "quantization": args.quantization,
              "kv_cache_dtype": args.kv_cache_dtype, "max_num_batched_tokens": args.max_num_batched_tokens,
              "attention_backend": args.attention_backend, "workload": args.workload, "requests": len(prompts),
              "policy": args.policy}
    (run_gpu if args.mode == "gpu" else run_host)(args, llm, prompts, params, result)
    print(json.dumps(result, indent=1), flush=True)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
