"""Digests of the schedules the policies make on the benchmark's workloads, through the simulator
(outputs forced to max_tokens, so a schedule depends on the prompts and the settings only): a
change that must not change scheduling keeps every digest. Torch-free.

    python -m batchllm.perf.schedule_digest [--scale 1.0] [--kv-cache-tokens 500000 60000]

`schedule` hashes each step's chunks (seq id, first position, token count, block-table change,
shared KV length, group, prefix flag, sample flag) and its preempted and finished ids; `counts`
hashes each step's token counts by kind, running requests and KV blocks in use (the step records)."""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from batchllm.perf.workload import make_workload, split_workload_spec
from batchllm.sched.config import POLICIES, SchedulerConfig
from batchllm.sched.interface import SchedulerOutput
from batchllm.sched.simulator import SimRequest, simulate

BENCH_WORKLOADS = ("micro:2000:200:16#1024", "industrial#2000", "micro:2000:1000:4#1024", "micro:16000:200:16#512")
BENCH_KV_CACHE_TOKENS = 500_000
BENCH_OUTPUT_TOKENS = 100


@dataclass(frozen=True)
class ScheduleDigest:
    workload: str
    policy: str
    num_kv_blocks: int
    num_steps: int  # scheduled steps, empty ones included
    num_preemptions: int
    schedule: str  # sha256 of every step's chunks and dropped ids
    counts: str  # sha256 of every step's token counts and KV blocks in use


def step_schedule_fields(output: SchedulerOutput) -> tuple:
    """What the schedule digest covers of one step."""
    chunks = tuple((c.seq_id, c.start_position, c.num_tokens, c.block_ids_start, c.new_block_ids, c.shared_kv_len,
                    c.group_id, c.is_prefix, c.sample) for c in output.chunks)
    return output.step_index, chunks, output.preempted_request_ids, output.finished_seq_ids


def step_count_fields(output: SchedulerOutput) -> tuple:
    """What the counts digest covers of one step."""
    return (output.num_decode_tokens, output.num_distinct_tokens, output.num_prefix_tokens,
            output.num_running_requests, output.num_used_blocks)


def workload_requests(spec: str, scale: float = 1.0, output_tokens: int = BENCH_OUTPUT_TOKENS) -> list[SimRequest]:
    """The requests of a benchmark workload spec ('industrial#2000'), scale times as many (seed 0)."""
    name, num_requests = split_workload_spec(spec, 1024)
    workload = make_workload(name, max(1, round(num_requests * scale)), output_tokens, 32000, 0)
    return [SimRequest(tuple(p.tolist()), int(m)) for p, m in zip(workload.prompts, workload.max_tokens)]


def schedule_digest(workload: str, requests: Sequence[SimRequest], config: SchedulerConfig) -> ScheduleDigest:
    schedule, counts = hashlib.sha256(), hashlib.sha256()
    num_steps = num_preemptions = 0

    def record(output: SchedulerOutput) -> None:
        nonlocal num_steps, num_preemptions
        num_steps += 1
        num_preemptions += len(output.preempted_request_ids)
        schedule.update(repr(step_schedule_fields(output)).encode())
        counts.update(repr(step_count_fields(output)).encode())

    simulate(requests, config, on_output=record)
    return ScheduleDigest(workload, config.policy, config.num_kv_blocks, num_steps, num_preemptions,
                          schedule.hexdigest(), counts.hexdigest())


def bench_digests(kv_cache_tokens: Sequence[int] = (BENCH_KV_CACHE_TOKENS,), scale: float = 1.0,
                  workloads: Sequence[str] = BENCH_WORKLOADS, policies: Sequence[str] = POLICIES,
                  block_size: int = 16, max_num_batched_tokens: int = 2048, decode_reserve_ratio: float = 1.0,
                  log=None) -> list[ScheduleDigest]:
    """Every policy on every workload at every KV cache size, with the benchmark's settings
    (decode_reserve_ratio < 1 lets the batchllm policy preempt)."""
    digests = []
    for workload in workloads:
        requests = workload_requests(workload, scale)
        for num_tokens in kv_cache_tokens:
            for policy in policies:
                config = SchedulerConfig(policy=policy, num_kv_blocks=num_tokens // block_size, block_size=block_size,
                                         max_num_batched_tokens=max_num_batched_tokens,
                                         decode_reserve_ratio=decode_reserve_ratio)
                started = time.perf_counter()
                digest = schedule_digest(workload, requests, config)
                digests.append(digest)
                if log is not None:
                    log(f"{workload} kv={num_tokens} {policy}: {digest.num_steps} steps, "
                        f"{digest.num_preemptions} preemptions, schedule {digest.schedule[:16]} "
                        f"counts {digest.counts[:16]} ({time.perf_counter() - started:.1f} s)")
    return digests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchllm.perf.schedule_digest", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of each workload's requests")
    parser.add_argument("--kv-cache-tokens", type=int, nargs="+", default=[BENCH_KV_CACHE_TOKENS])
    parser.add_argument("--workload", action="append", default=None, help="default: the benchmark's four")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--decode-reserve-ratio", type=float, default=1.0, help="the batchllm policy's (default 1.0)")
    args = parser.parse_args(argv)
    bench_digests(args.kv_cache_tokens, args.scale, args.workload or BENCH_WORKLOADS, args.policies.split(","),
                  decode_reserve_ratio=args.decode_reserve_ratio, log=lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
