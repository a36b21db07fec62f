"""The host's work per step without a model: the engine's step loop, scheduler, persistent rows,
step inputs and attention plan, driven by a fake runner whose sampled token is a fixed function of
the request and its output index (outputs run to max_tokens). Milliseconds per step, by part:

    schedule / update   the policy's schedule() and update()
    inputs              the runner's persistent rows and StepInputs (BatchRows, build_step_inputs)
    plan                the fused backend's work list (Llama-3.1-8B heads, 132 SMs: an H200)
    loop                the rest of the step loop: sampling rows, reading ids, stop checks, reasons

    python -m batchllm.perf.host_cost --workload uniform:128:128 --requests 3000 30000 \\
        --budgets 2048 8192 --repeat 3 [--max-steps N] [--out host_cost.json]

Times are this process's CPU time (time.process_time), so that other work on a shared machine
counts less. Each setting runs --repeat times in this process, interleaved; the table gives the
median of the runs' per-step means and their spread (min-max)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np

DEFAULT_KV_CACHE_TOKENS = 1_820_000  # Llama-3.1-8B with an FP8 KV cache on one H200, after weights
PARTS = ("schedule", "update", "inputs", "plan", "loop")
NUM_SMS = 132  # H200
LLAMA_HEADS = (32, 8, 128)  # query heads, KV heads, head dim


@dataclass
class _Clock:
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys((*PARTS, "fake_sampling"), 0.0))

    def add(self, part: str, started: float) -> float:
        now = time.process_time()
        self.seconds[part] += now - started
        return now


class _TimedScheduler:
    """The policy, its schedule() and update() timed."""

    def __init__(self, scheduler, clock: _Clock) -> None:
        self.scheduler, self.clock = scheduler, clock

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def schedule(self):
        started = time.process_time()
        output = self.scheduler.schedule()
        self.clock.add("schedule", started)
        return output

    def update(self, output, finish_reasons):
        started = time.process_time()
        finished = self.scheduler.update(output, finish_reasons)
        self.clock.add("update", started)
        return finished


class _FakeRunner:
    """A StepRunner that builds the step's inputs and plan as ModelRunner does and samples token
    (request id * 7919 + output index * 104729) mod 31000 + 1000."""

    def __init__(self, block_size: int, clock: _Clock) -> None:
        from batchllm.attention_plan.tile_config import decode_tile_config
        from batchllm.engine.batch_rows import BatchRows

        self.block_size, self.clock = block_size, clock
        self.rows = BatchRows()
        num_heads, num_kv_heads, head_dim = LLAMA_HEADS
        self.decode_tile = decode_tile_config(head_dim, num_heads // num_kv_heads, interpret=False)

    def execute(self, output, sampling_rows, allow_graph: bool = True, constraint=None, prompt_logprobs=None):
        import torch

        from batchllm.attention_plan.work_list import build_prefix_shared_plan
        from batchllm.engine.sampler import SamplerOutput
        from batchllm.engine.step_inputs import build_step_inputs
        from batchllm.engine.step_result import StepResult

        started = time.process_time()
        inputs = build_step_inputs(output, self.block_size, self.rows.step_rows(output))
        started = self.clock.add("inputs", started)
        num_heads, num_kv_heads, head_dim = LLAMA_HEADS
        build_prefix_shared_plan(inputs.query_start_loc, inputs.seq_lens, inputs.shared_kv_lens, inputs.block_tables,
                                 inputs.group_ids, inputs.is_prefix, block_size=self.block_size,
                                 num_kv_heads=num_kv_heads, num_heads=num_heads, head_dim=head_dim,
                                 tile=self.decode_tile if inputs.decode_only else None, num_sms=NUM_SMS)
        started = self.clock.add("plan", started)
        if not len(sampling_rows):
            return StepResult((), None)
        output_index = getattr(sampling_rows, "output_index", None)
        if output_index is None:  # a list of sampling_row tuples
            output_index = np.array([row[5] for row in sampling_rows], dtype=np.int64)
        seq_ids = np.asarray(inputs.sample_seq_ids, dtype=np.int64)
        token_ids = (seq_ids * 7919 + output_index * 104729) % 31000 + 1000
        result = StepResult(inputs.sample_seq_ids, SamplerOutput(torch.from_numpy(token_ids)))
        self.clock.add("fake_sampling", started)
        return result


def measure(workload: str, num_requests: int, budget: int, kv_cache_tokens: int, policy: str = "batchllm",
            max_steps: int | None = None, block_size: int = 16) -> dict:
    """One run: ms per step of each part, steps run, seconds to plan the batch (add_requests)."""
    from batchllm.engine.request_state import RequestState, RunStats
    from batchllm.engine.step_loop import StepLoop
    from batchllm.engine.stop_checker import StopChecker
    from batchllm.perf.workload import make_workload, prepared_requests, split_workload_spec
    from batchllm.sched.config import SchedulerConfig
    from batchllm.sched.factory import make_scheduler

    spec, _ = split_workload_spec(workload, num_requests)
    requests = prepared_requests(make_workload(spec, num_requests, 100, 32000, 0))
    states = {}
    for request in requests:
        params = request.params
        stop = StopChecker(params, params.max_tokens, frozenset({2}), lambda ids: "")
        states[request.request_id] = RequestState(request, stop, request.request_id, None)
    config = SchedulerConfig(policy=policy, num_kv_blocks=kv_cache_tokens // block_size, block_size=block_size,
                             max_num_batched_tokens=budget)
    clock = _Clock()
    scheduler = make_scheduler(config)
    started = time.process_time()
    scheduler.add_requests([state.sched_request() for state in states.values()])
    plan_s = time.process_time() - started
    stats = RunStats()
    loop = StepLoop(_TimedScheduler(scheduler, clock), _FakeRunner(block_size, clock), states, depth=1,
                    allow_graph=True, stats=stats)
    started = time.process_time()
    for _ in loop.run():
        if max_steps is not None and stats.num_steps >= max_steps:
            break
    wall_s = time.process_time() - started
    seconds = clock.seconds
    seconds["loop"] = wall_s - sum(seconds[p] for p in (*PARTS[:-1], "fake_sampling"))
    steps = max(stats.num_steps, 1)
    per_step = {part: 1000 * seconds[part] / steps for part in PARTS}
    per_step["total"] = sum(per_step.values())
    return {"steps": stats.num_steps, "ms_per_step": per_step, "add_requests_s": plan_s,
            "output_tokens": stats.num_output_tokens}


def run_settings(workload: str, request_counts: list[int], budgets: list[int], kv_cache_tokens: int, policy: str,
                 repeat: int, max_steps: int | None, log=None) -> list[dict]:
    """Every (requests, budget) setting, repeat times, interleaved; one row per setting."""
    runs: dict[tuple[int, int], list[dict]] = {(n, b): [] for n in request_counts for b in budgets}
    for _ in range(repeat):
        for (num_requests, budget), results in runs.items():
            result = measure(workload, num_requests, budget, kv_cache_tokens, policy, max_steps)
            results.append(result)
            if log is not None:
                parts = " ".join(f"{p} {v:.2f}" for p, v in result["ms_per_step"].items())
                log(f"{workload}#{num_requests} budget {budget}: {result['steps']} steps, ms/step {parts}")
    rows = []
    for (num_requests, budget), results in runs.items():
        row = {"workload": workload, "requests": num_requests, "budget": budget, "policy": policy,
               "steps": results[0]["steps"], "add_requests_s": statistics.median(r["add_requests_s"] for r in results)}
        for part in (*PARTS, "total"):
            values = [r["ms_per_step"][part] for r in results]
            row[part] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| requests | budget | steps | " + " | ".join(f"{p} ms" for p in (*PARTS, "total")) + " |",
             "|" + "---:|" * (4 + len(PARTS))]
    for row in rows:
        cells = [f"{row[p]['median']:.2f} ({row[p]['min']:.2f}-{row[p]['max']:.2f})" for p in (*PARTS, "total")]
        lines.append(f"| {row['requests']} | {row['budget']} | {row['steps']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchllm.perf.host_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="uniform:128:128", help="a generated workload spec (perf/workload.py)")
    parser.add_argument("--requests", type=int, nargs="+", default=[3000, 30000])
    parser.add_argument("--budgets", type=int, nargs="+", default=[2048, 8192], help="max_num_batched_tokens")
    parser.add_argument("--kv-cache-tokens", type=int, default=DEFAULT_KV_CACHE_TOKENS)
    parser.add_argument("--policy", default="batchllm")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=None, help="stop each run after this many steps")
    parser.add_argument("--out", default=None, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if args.repeat < 1 or min(args.requests) < 1 or min(args.budgets) < 1:
        print("error: --repeat, --requests and --budgets must be >= 1", file=sys.stderr)
        return 2
    rows = run_settings(args.workload, args.requests, args.budgets, args.kv_cache_tokens, args.policy, args.repeat,
                        args.max_steps, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(markdown(rows))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as file:
            json.dump(rows, file, indent=1)
            file.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
