"""Host milliseconds per engine step: the scheduler's `schedule()` and the runner's input building.

No model and no GPU: each policy runs a paper workload with the simulator's fake sampling
(every request runs to its max_tokens); per step it times

  schedule  scheduler.schedule()
  inputs    what ModelRunner.execute does on the host before the forward: apply the step's
            block-table changes to the persistent table, gather the step's rows, and
            build_step_inputs (numpy arrays)

and prints mean / p50 / p90 per step for every (workload, policy, max_num_batched_tokens).
--clock cpu times the process's CPU time instead of wall time (steadier on a shared machine).

    PYTHONPATH=. python3 benchmarks/host_step_time.py
    PYTHONPATH=. python3 benchmarks/host_step_time.py --num-requests 1024 --policies batchllm,vllm \\
        --max-num-batched-tokens 2048,8192 --json host_step_time.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from batchllm.engine.batch_rows import BatchRows
from batchllm.engine.step_inputs import build_step_inputs
from batchllm.sched.config import SchedulerConfig
from batchllm.sched.factory import make_scheduler
from batchllm.sched.interface import SchedRequest
from batchllm.sched.simulator import fake_token
from batchllm.perf.workloads import industrial_workload, micro_workload

BLOCK_SIZE = 16


def make_requests(spec: str, num_requests: int) -> list[SchedRequest]:
    """spec: "micro:P/D/SD" (prefix / distinct tokens / sharing degree) or "industrial"."""
    if spec == "industrial":
        workload = industrial_workload(num_requests=num_requests)
    elif spec.startswith("micro:"):
        try:
            prefix, distinct, degree = (int(x) for x in spec[len("micro:"):].split("/"))
        except ValueError as error:
            raise SystemExit(f"bad workload {spec!r}: write micro:P/D/SD, e.g. micro:2000/200/16") from error
        workload = micro_workload(prefix, distinct, degree, num_requests=num_requests)
    else:
        raise SystemExit(f"unknown workload {spec!r}: micro:P/D/SD or industrial")
    return [SchedRequest(i, p.tolist(), int(m)) for i, (p, m) in enumerate(zip(workload.prompts, workload.max_tokens))]


def time_steps(requests: list[SchedRequest], config: SchedulerConfig,
               clock=time.perf_counter) -> tuple[list[float], list[float]]:
    """Run the batch; returns (schedule ms, inputs ms) per non-empty step."""
    scheduler = make_scheduler(config)
    scheduler.add_requests(requests)
    rows = BatchRows()
    max_tokens = {r.request_id: r.max_tokens for r in requests}
    schedule_ms, inputs_ms = [], []
    while scheduler.has_unfinished():
        started = clock()
        output = scheduler.schedule()
        scheduled = clock()
        build_step_inputs(output, config.block_size, rows.step_rows(output))
        built = clock()
        if output.chunks:
            schedule_ms.append((scheduled - started) * 1e3)
            inputs_ms.append((built - scheduled) * 1e3)
        finish = {}
        for chunk in output.chunks:
            if chunk.sample:
                request = requests[chunk.seq_id]
                request.output_token_ids.append(fake_token(chunk.seq_id, len(request.output_token_ids)))
                if len(request.output_token_ids) >= max_tokens[chunk.seq_id]:
                    finish[chunk.seq_id] = "length"
        scheduler.update(output, finish)
    return schedule_ms, inputs_ms


def summary(values: list[float]) -> dict[str, float]:
    array = np.asarray(values)
    return {"mean": float(array.mean()), "p50": float(np.percentile(array, 50)), "p90": float(np.percentile(array, 90))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="micro:2000/200/16,industrial", help="comma-separated")
    parser.add_argument("--num-requests", type=int, default=1024)
    parser.add_argument("--policies", default="batchllm,vllm", help="comma-separated")
    parser.add_argument("--kv-cache-tokens", type=int, default=500_000)
    parser.add_argument("--max-num-batched-tokens", default="2048,8192", help="comma-separated")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    budgets = [int(x) for x in args.max_num_batched_tokens.split(",")]
    rows = []
    print("| workload | policy | N_chunk | steps | schedule ms mean / p50 / p90 | inputs ms mean / p50 / p90 |")
    print("|---|---|---|---|---|---|")
    for spec in args.workloads.split(","):
        for policy in args.policies.split(","):
            for budget in budgets:
                config = SchedulerConfig(policy=policy, num_kv_blocks=args.kv_cache_tokens // BLOCK_SIZE,
                                         block_size=BLOCK_SIZE, max_num_batched_tokens=budget)
                clock = time.perf_counter if args.clock == "wall" else time.process_time
                schedule_ms, inputs_ms = time_steps(make_requests(spec, args.num_requests), config, clock)
                row = {"workload": spec, "policy": policy, "max_num_batched_tokens": budget, "clock": args.clock,
                       "steps": len(schedule_ms),
                       "schedule_ms": summary(schedule_ms), "inputs_ms": summary(inputs_ms)}
                rows.append(row)
                cells = [" / ".join(f"{row[k][s]:.3f}" for s in ("mean", "p50", "p90")) for k in ("schedule_ms", "inputs_ms")]
                print(f"| {spec} | {policy} | {budget} | {row['steps']} | {cells[0]} | {cells[1]} |", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(rows, file, indent=1)
            file.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
