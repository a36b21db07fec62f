"""Tensor parallelism on one host: correctness (TP=N vs TP=1 tokens) and throughput.

    # tokens of TP=2 vs TP=1 (random weights, fixed seed), float32 (exact) and bf16 (match rate)
    PYTHONPATH=. python benchmarks/scale_out_tp.py check --model 'random:qwen2.5-14b?num_layers=4' --tp 2
    # throughput of one configuration (run each in its own process)
    PYTHONPATH=. python benchmarks/scale_out_tp.py throughput --model random:qwen2.5-14b --tp 2 \
        --workload micro:2000:200:16 --requests 64 --kv-cache-tokens 65536

Outputs are forced to a fixed length (ignore_eos); a warm-up batch runs first (Triton compile
excluded). One JSON line per measurement on stdout (and appended to --out).
"""

from __future__ import annotations

import argparse
import json
import time


def make_requests(spec: str, num_requests: int, output_tokens: int, temperature: float = 0.0,
                  vocab_size: int = 32000):
    from batchllm.engine.llm_engine import PreparedRequest
    from batchllm.sampling_params import SamplingParams
    from batchllm.workloads import micro_workload

    kind, prefix, distinct, degree = spec.split(":")
    if kind != "micro":
        raise SystemExit("workload must be micro:P:D:SD")
    workload = micro_workload(int(prefix), int(distinct), int(degree), num_requests=num_requests,
                              output_num_tokens=output_tokens, vocab_size=vocab_size,
                              low_token_id=min(1000, vocab_size // 4))
    return [PreparedRequest(i, prompt.tolist(), SamplingParams(max_tokens=output_tokens, temperature=temperature,
                                                               seed=1000 + i, ignore_eos=True))
            for i, prompt in enumerate(workload.prompts)]


def engine_config(args, dtype: str):
    from batchllm.config import EngineConfig
    from batchllm.sched.config import SchedulerConfig

    return EngineConfig(model=args.model, dtype=dtype, kv_cache_tokens=args.kv_cache_tokens, seed=0,
                        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens))


def run_tokens(engine, requests) -> dict[int, list[int]]:
    return {o.request_id: list(o.output_token_ids) for o in engine.run(requests)}


def emit(record: dict, out: str | None) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if out:
        with open(out, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")


def check(args) -> None:
    """TP=1 and TP=N tokens, in one process (the TP=1 engine is freed before TP=N starts)."""
    import gc

    import torch

    from batchllm.engine.factory import create_engine

    greedy = make_requests(args.workload, args.requests, args.output_tokens, 0.0, args.vocab_size)
    sampled = make_requests(args.workload, args.requests, args.output_tokens, 1.0, args.vocab_size)
    for dtype in args.dtypes.split(","):
        torch.backends.cuda.matmul.allow_tf32 = False
        results = {}
        for tp in (1, args.tp):
            engine = create_engine(engine_config(args, dtype), tensor_parallel_size=tp)
            results[tp] = (run_tokens(engine, greedy), run_tokens(engine, sampled))
            if tp > 1:
                engine.shutdown()
            del engine
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        record = {"what": "tp_check", "model": args.model, "dtype": dtype, "tp": args.tp, "requests": args.requests,
                  "output_tokens": args.output_tokens}
        for index, kind in enumerate(("greedy", "sampled")):
            one, many = results[1][index], results[args.tp][index]
            same_tokens = sum(a == b for i in one for a, b in zip(one[i], many[i]))
            total = sum(len(one[i]) for i in one)
            record[f"{kind}_equal"] = one == many
            record[f"{kind}_token_match"] = same_tokens / total
            record[f"{kind}_distinct_sequences"] = len({tuple(v) for v in one.values()})
        emit(record, args.out)


def throughput(args) -> None:
    import torch

    from batchllm.engine.factory import create_engine
    from batchllm.engine.llm_engine import RunStats

    requests = make_requests(args.workload, args.requests, args.output_tokens, 0.0, args.vocab_size)
    started = time.perf_counter()
    engine = create_engine(engine_config(args, "bfloat16"), tensor_parallel_size=args.tp)
    load_s = time.perf_counter() - started
    run_tokens(engine, make_requests(args.workload, 16, 4, 0.0, args.vocab_size))  # warm-up: Triton compile, allocator
    stats = RunStats()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    outputs = {o.request_id: o for o in engine.run(requests, stats=stats)}
    seconds = time.perf_counter() - started
    record = {
        "what": "tp_throughput", "model": args.model, "tp": args.tp, "workload": args.workload,
        "requests": len(outputs), "output_tokens": stats.num_output_tokens, "prompt_tokens": stats.num_prompt_tokens,
        "seconds": round(seconds, 3), "requests_per_s": round(len(outputs) / seconds, 2),
        "output_tokens_per_s": round(stats.num_output_tokens / seconds, 1), "steps": stats.num_steps,
        "load_s": round(load_s, 1), "kv_cache_tokens": engine.num_kv_tokens,
        "gpu_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if torch.cuda.is_available() else None,
    }
    emit(record, args.out)
    if args.tp > 1:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["check", "throughput"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--workload", default="micro:2000:200:16")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=100)
    parser.add_argument("--kv-cache-tokens", type=int, default=65536)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--vocab-size", type=int, default=32000, help="prompt token ids drawn below this")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="check mode: dtypes to compare in")
    parser.add_argument("--out", default=None, help="also append the JSON lines here")
    args = parser.parse_args()
    check(args) if args.mode == "check" else throughput(args)


if __name__ == "__main__":
    main()
