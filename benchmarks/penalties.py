"""What sampling penalties cost: the same batch with presence, frequency and repetition penalties on
every request and with none.

engine: every request ignores EOS, so both runs generate the same tokens count in the same steps;
the ratio of their output tokens/s is the penalties' cost (target: penalties on every row cost at
most 5% of the step time). A warm-up batch of 8 requests of each kind runs first.

    PYTHONPATH=. python3 benchmarks/penalties.py engine --model random:llama-3.1-8b \\
        --workload micro:1000:100:16 --requests 1024 --output-tokens 256 --out penalties.json
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from batchllm.perf.result_files import report_result
from batchllm.sched.config import DEFAULT_MAX_NUM_BATCHED_TOKENS

PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}


def timed_run(engine, requests: list) -> dict:
    from batchllm.engine.request_state import RunStats

    stats = RunStats()
    started = time.perf_counter()
    for _ in engine.run(requests, stats=stats):
        pass
    seconds = time.perf_counter() - started
    return {"seconds": round(seconds, 3), "output_tokens": stats.num_output_tokens, "steps": stats.num_steps,
            "output_tokens_per_s": round(stats.num_output_tokens / seconds, 1),
            "ms_per_step": round(1000 * seconds / max(stats.num_steps, 1), 3)}


def run_engine(args) -> dict:
    from batchllm.config import engine_config
    from batchllm.engines import build_engine
    from batchllm.perf.workload import make_workload, prepared_requests

    engine = build_engine(engine_config(args.model, device=args.device, dtype=args.dtype,
                                        kv_cache_tokens=args.kv_cache_tokens,
                                        max_num_batched_tokens=args.max_num_batched_tokens))
    workload = make_workload(args.workload, args.requests, args.output_tokens, engine.arch.vocab_size, args.seed)
    plain, penalised = [], []
    for request in prepared_requests(workload):
        params = dataclasses.replace(engine.limits.check(request.prompt_token_ids, request.params),
                                     temperature=args.temperature, seed=request.request_id, ignore_eos=True)
        plain.append(dataclasses.replace(request, params=params))
        penalised.append(dataclasses.replace(request, params=dataclasses.replace(params, **PENALTIES)))
    for warm in (plain[:8], penalised[:8]):
        timed_run(engine, warm)
    result = {"model": args.model, "workload": args.workload, "requests": len(plain),
              "output_tokens": args.output_tokens, "temperature": args.temperature, "penalties": PENALTIES}
    for repeat in range(args.repeats):
        result[f"none_{repeat}"] = timed_run(engine, plain)
        result[f"every_row_{repeat}"] = timed_run(engine, penalised)
    best = {kind: max(result[f"{kind}_{r}"]["output_tokens_per_s"] for r in range(args.repeats))
            for kind in ("none", "every_row")}
    result["ratio"] = round(best["every_row"] / best["none"], 3)
    result["step_time_cost"] = round(best["none"] / best["every_row"] - 1, 3)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(dest="mode", required=True)
    engine = modes.add_parser("engine", help="output tokens/s with penalties on every row and with none")
    engine.add_argument("--model", default="random:llama-3.1-8b")
    engine.add_argument("--workload", default="micro:1000:100:16")
    engine.add_argument("--requests", type=int, default=1024)
    engine.add_argument("--output-tokens", type=int, default=256)
    engine.add_argument("--repeats", type=int, default=2, help="runs of each kind, alternating (the best counts)")
    engine.add_argument("--dtype", default="auto")
    engine.add_argument("--kv-cache-tokens", type=int, default=None)
    engine.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS)
    engine.add_argument("--device", default="auto")
    engine.add_argument("--temperature", type=float, default=1.0)
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--out", default=None, metavar="FILE.json")
    args = parser.parse_args(argv)
    result = run_engine(args)
    report_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
