r"""Tensor parallelism on one host: throughput of one configuration (run each in its own process).

    PYTHONPATH=. python3 benchmarks/scale_out_tp.py --model random:qwen2.5-14b --tp 2 \
        --workload micro:2000:200:16#1024 --out scale_out_tp.jsonl

The requests are `batchllm bench`'s for the same workload spec (outputs forced to a fixed
length), and the KV cache fills the free memory unless --kv-cache-tokens says otherwise. The same
batch runs once untimed first, so every Triton kernel and CUDA graph the timed run needs exists
before the clock starts. After the timed run, on CUDA, the first --profile-requests requests run
again under the profiler on rank 0: the collectives' GPU time per step of that run
(`all_reduce_ms_per_step`: NCCL kernels, the logits all-gather included), their share of its GPU
kernel time, GPU time by kernel class, and the time rank 0's GPU had any kernel running
(`gpu_busy_ms_per_step`; profile every request to set it against the timed run's step_ms). The
bound is the FLOP bound over all tp GPUs: the work's FLOPs / (tp x the measured bf16 peak). One
JSON line on stdout (and appended to --out). Token equality of TP=N and TP=1 is tested on the CPU
(tests/test_distributed_tp.py) and on two GPUs (tests/test_distributed_tp_gpu.py).
"""

from __future__ import annotations

import argparse
import json
import time

from batchllm.sched.config import DEFAULT_MAX_NUM_BATCHED_TOKENS


def flop_bound(arch, requests, tp: int) -> float:
    """The FLOP bound of the batch on tp GPUs, each at the measured bf16 peak."""
    from batchllm.perf.flop_bound import H200_BF16_PEAK_FLOPS, flop_bound_seconds, plan_groups
    from batchllm.prefix.planner import plan_prefix_groups

    plan = plan_prefix_groups([r.prompt_token_ids for r in requests])
    return flop_bound_seconds(arch, plan_groups(plan), [r.params.max_tokens for r in requests],
                              tp * H200_BF16_PEAK_FLOPS)


def busy_us(intervals) -> float:
    """Length of the union of (start, end) intervals: the time at least one kernel ran."""
    total, covered_until = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > covered_until:
            total += end - max(start, covered_until)
            covered_until = end
    return total


KERNEL_CLASSES = (("collective", ("nccl",)), ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "sm90_")),
                  ("attention", ("prefix_shared", "attention", "attn", "merge_partials")))


def kernel_class(name: str) -> str:
    """The class of a CUDA kernel by its name: collective, gemm, attention, or other."""
    lowered = name.lower()
    return next((label for label, keys in KERNEL_CLASSES if any(key in lowered for key in keys)), "other")


def profile_collectives(engine, requests) -> dict:
    """The collectives' GPU time, from a profiled run of `requests` (after the timed run: the
    profiler stays out of the timing, and every graph is captured already)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from batchllm.engine.llm_engine import RunStats

    if not requests:
        return {}
    stats = RunStats()
    with profile(activities=[ProfilerActivity.CUDA]) as run_profile:
        run_tokens(engine, requests, stats)
        torch.cuda.synchronize()
    kernel_us = {event.key: event.self_device_time_total for event in run_profile.key_averages()}
    collective_us = sum(us for name, us in kernel_us.items() if "nccl" in name.lower())
    kernel_spans = [(event.time_range.start, event.time_range.end) for event in run_profile.events()
                    if event.device_type == torch.autograd.DeviceType.CUDA]
    num_steps = max(stats.num_steps, 1)
    class_us: dict[str, float] = {}
    for name, us in kernel_us.items():
        label = kernel_class(name)
        class_us[label] = class_us.get(label, 0.0) + us
    top_kernels = sorted(kernel_us.items(), key=lambda item: -item[1])[:12]
    return {"profiled_requests": len(requests), "profiled_steps": stats.num_steps,
            "all_reduce_ms_per_step": round(collective_us / 1000 / num_steps, 2),
            "gpu_kernel_ms_per_step": round(sum(kernel_us.values()) / 1000 / num_steps, 2),
            # rank 0's GPU with at least one kernel running; with every request profiled, the
            # timed run's step_ms minus this is the time its GPU waited (for launches or a peer)
            "gpu_busy_ms_per_step": round(busy_us(kernel_spans) / 1000 / num_steps, 2),
            "all_reduce_share_of_gpu_time": round(collective_us / max(sum(kernel_us.values()), 1), 4),
            "kernel_class_ms_per_step": {label: round(us / 1000 / num_steps, 2) for label, us in sorted(class_us.items())},
            "top_kernels_ms_per_step": [[name[:80], round(us / 1000 / num_steps, 2)] for name, us in top_kernels]}


def phase_ms_per_step(steps) -> dict:
    """Mean host ms per step: scheduling, launching (input building included), waiting for tokens;
    and the mean step of the decode-only steps and of the steps with prompt tokens."""
    num_steps = max(len(steps), 1)
    decode_only = [s for s in steps if s.num_tokens == s.num_decode_tokens]
    with_prompt = [s for s in steps if s.num_tokens > s.num_decode_tokens]

    def mean_ms(records) -> float:
        return round(1000 * sum(s.step_time_s for s in records) / max(len(records), 1), 2)

    return {f"{name}_ms_per_step": round(1000 * sum(getattr(s, f"{name}_time_s") for s in steps) / num_steps, 2)
            for name in ("schedule", "launch", "wait")} | {
        "step_ms": mean_ms(steps), "decode_only_steps": len(decode_only), "decode_only_step_ms": mean_ms(decode_only),
        "prompt_step_ms": mean_ms(with_prompt)}


def engine_config(args):
    from batchllm.config import engine_config as build_config

    return build_config(args.model, dtype="bfloat16", kv_cache_tokens=args.kv_cache_tokens, seed=0,
                        max_num_batched_tokens=args.max_num_batched_tokens, tensor_parallel_size=args.tp)


def run_tokens(engine, requests, stats=None) -> dict[int, list[int]]:
    return {o.request_id: list(o.output_token_ids) for o in engine.run(requests, stats=stats)}


def emit(record: dict, out: str | None) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if out:
        with open(out, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")


def throughput(args) -> None:
    import torch

    from batchllm.perf.runner import graph_replay_counts, graph_replays_since
    from batchllm.perf.workload import make_workload, prepared_requests, split_workload_spec
    from batchllm.engines import build_engine
    from batchllm.engine.llm_engine import RunStats

    spec, num_requests = split_workload_spec(args.workload, 1024)
    requests = prepared_requests(make_workload(spec, num_requests, args.output_tokens, args.vocab_size, 0))
    started = time.perf_counter()
    engine = build_engine(engine_config(args))
    load_s = time.perf_counter() - started
    cuda = torch.cuda.is_available()
    run_tokens(engine, requests)  # warm-up: the same batch, so every kernel and graph exists
    stats = RunStats()
    replays_before = graph_replay_counts(engine.runner)
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    outputs = run_tokens(engine, requests, stats)
    seconds = time.perf_counter() - started
    # decode steps of the timed run replayed as CUDA graphs (0 without graphs)
    timed_replays = {"graph_replays": 0, **graph_replays_since(engine.runner, replays_before)}
    collectives = profile_collectives(engine, requests[:args.profile_requests]) if cuda else {}
    bound = flop_bound(engine.arch, requests, args.tp)
    record = {
        "what": "tp_throughput", "model": args.model, "tp": args.tp, "workload": args.workload,
        "requests": len(outputs), "output_tokens": stats.num_output_tokens, "prompt_tokens": stats.num_prompt_tokens,
        "seconds": round(seconds, 3), "requests_per_s": round(len(outputs) / seconds, 2),
        "output_tokens_per_s": round(stats.num_output_tokens / seconds, 1),
        "flop_bound_s": round(bound, 3), "time_over_bound": round(seconds / bound, 2), "steps": stats.num_steps,
        **phase_ms_per_step(stats.step_records),
        **collectives,
        **timed_replays,
        "max_num_batched_tokens": args.max_num_batched_tokens, "load_s": round(load_s, 1),
        "kv_cache_tokens": engine.num_kv_tokens,
        "gpu_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
    }
    emit(record, args.out)
    if args.tp > 1:
        engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--workload", default="micro:2000:200:16#1024",
                        help="micro:P:D:SD or industrial, optionally #REQUESTS (as in batchllm bench; default 1024)")
    parser.add_argument("--output-tokens", type=int, default=100)
    parser.add_argument("--kv-cache-tokens", type=int, default=None, help="default: fill the free GPU memory")
    parser.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                        help="token budget per step")
    parser.add_argument("--vocab-size", type=int, default=32000, help="prompt token ids drawn below this")
    parser.add_argument("--profile-requests", type=int, default=256,
                        help="on CUDA: profile a run of the first N requests for the collectives' time (0: none)")
    parser.add_argument("--out", default=None, help="also append the JSON line here")
    throughput(parser.parse_args(argv))


if __name__ == "__main__":
    main()
