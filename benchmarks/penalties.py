"""What sampling penalties cost: the same batch with presence, frequency and repetition penalties on
every request and with none (engine), and the sampler alone on [rows, vocab] logits (sampler).

engine: every request ignores EOS, so both runs generate the same tokens count in the same steps;
the ratio of their output tokens/s is the penalties' cost (target: penalties on every row cost at
most 5% of the step time). A warm-up batch of 8 requests of each kind runs first.

    PYTHONPATH=. python3 benchmarks/penalties.py engine --model random:llama-3.1-8b \\
        --workload micro:1000:100:16 --requests 1024 --output-tokens 256 --out penalties.json

sampler: milliseconds per sample() call of --rows rows over --vocab-size, with penalties on every
row (the count table's gather, the penalty ops and the count update) and with none.

    PYTHONPATH=. python3 benchmarks/penalties.py sampler --rows 256 --vocab-size 128256
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

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


def run_sampler(args) -> dict:
    import numpy as np
    import torch

    from batchllm.engine.penalties import PenaltyTable
    from batchllm.engine.sampler import SamplingBatch, sample, sampling_row
    from batchllm.engine.sampling_rows import PenaltyRows, SamplingRows
    from batchllm.sampling_params import SamplingParams

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = SamplingRows.from_tuples([sampling_row(SamplingParams(temperature=args.temperature), i, 0)
                                     for i in range(args.rows)])
    every_row = np.arange(args.rows, dtype=np.int64)
    values = {name: np.full(args.rows, value, dtype=np.float32) for name, value in PENALTIES.items()}
    penalties = PenaltyRows(every_row, every_row, values["presence_penalty"], values["frequency_penalty"],
                            values["repetition_penalty"], args.rows, every_row, every_row, every_row % 1000,
                            np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    batches = {"none": SamplingBatch.build(rows, device),
               "every_row": SamplingBatch.build(dataclasses.replace(rows, penalties=penalties), device)}
    table = PenaltyTable(device)
    logits = torch.randn(args.rows, args.vocab_size, device=device)
    result = {"device": str(device), "rows": args.rows, "vocab_size": args.vocab_size, "steps": args.steps}
    for kind, batch in batches.items():
        sample(logits, batch, penalty_table=table)  # warm-up: the table's allocation, the slots' start
        if batch.penalties is not None:  # later steps: the slots are running
            batch = dataclasses.replace(batch, penalties=dataclasses.replace(batch.penalties, new_slots=None))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        for _ in range(args.steps):
            sample(logits, batch, penalty_table=table)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        result[f"{kind}_ms"] = round(1000 * (time.perf_counter() - started) / args.steps, 3)
    result["extra_ms"] = round(result["every_row_ms"] - result["none_ms"], 3)
    result["table_bytes"] = table.num_bytes
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
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    sampler = modes.add_parser("sampler", help="milliseconds per sample() call")
    sampler.add_argument("--rows", type=int, default=256)
    sampler.add_argument("--vocab-size", type=int, default=128256)
    sampler.add_argument("--steps", type=int, default=50)
    for mode in (engine, sampler):
        mode.add_argument("--device", default="auto")
        mode.add_argument("--temperature", type=float, default=1.0)
        mode.add_argument("--seed", type=int, default=0)
        mode.add_argument("--out", default=None, metavar="FILE.json")
    args = parser.parse_args(argv)
    result = run_engine(args) if args.mode == "engine" else run_sampler(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    return result


if __name__ == "__main__":
    main()
