"""Drive a scheduling policy without a model: fake sampling + a linear cost model (torch-free).
docs/design.md ("Simulating schedules") explains both and derives the cost model's constants."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from batchllm.sched.checker import ChunkStreamChecker
from batchllm.sched.config import SchedulerConfig
from batchllm.sched.factory import make_scheduler
from batchllm.sched.interface import SchedRequest, SchedulerOutput
from batchllm.sched.trace import StepRecord, Trace

FAKE_VOCAB_SIZE = 32000
MAX_EMPTY_STEPS = 3


@dataclass(frozen=True)
class CostModel:
    weights_read_s: float = 3.4e-3
    token_compute_s: float = 2.7e-5
    kv_token_read_s: float = 2.7e-8

    def step_time_s(self, output: SchedulerOutput) -> float:
        num_tokens = output.num_tokens
        kv_tokens_read = 0
        shared_seen: set[tuple[int, int]] = set()
        for chunk in output.chunks:
            kv_tokens_read += chunk.kv_len - chunk.shared_kv_len
            if chunk.shared_kv_len and (chunk.group_id, chunk.shared_kv_len) not in shared_seen:
                shared_seen.add((chunk.group_id, chunk.shared_kv_len))
                kv_tokens_read += chunk.shared_kv_len
        return max(self.weights_read_s, num_tokens * self.token_compute_s) + kv_tokens_read * self.kv_token_read_s


@dataclass(frozen=True)
class SimRequest:
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class SimResult:
    policy: str
    num_requests: int
    finished_requests: int
    steps: int
    total_tokens: int
    mean_tokens_per_step: float
    valley_steps: int  # steps with fewer than half of max_num_batched_tokens
    logical_prefill_tokens: int  # sum of prompt lengths
    processed_prefill_tokens: int  # prompt/prefix tokens actually computed (recompute included)
    saving_ratio: float  # BatchLLM Eq. 2: (logical - processed) / logical
    decode_tokens: int
    peak_kv_blocks: int
    peak_kv_tokens: int
    preemptions: int
    estimated_time_s: float
    max_num_batched_tokens: int
    num_kv_blocks: int
    block_size: int


def fake_token(request_id: int, output_index: int) -> int:
    return (request_id * 7919 + output_index * 104729 + 17) % FAKE_VOCAB_SIZE


def simulate(
    requests: Sequence[SimRequest],
    config: SchedulerConfig,
    trace_label: str | None = None,
    check: bool = False,
    on_output: Callable[[SchedulerOutput], None] | None = None,
) -> tuple[SimResult, Trace | None, dict[int, tuple[int, ...]]]:
    """Run the whole batch; returns (result, trace or None, outputs per request index).
    on_output: called with every step's SchedulerOutput before its update (replays of real
    steps, e.g. perf/schedule_replay.py; block tables arrive as changes: rebuild them with
    sched/block_table.BlockTableTracker, fed every step)."""
    cost_model = CostModel()
    sched_requests = [SchedRequest(i, list(r.prompt_token_ids), r.max_tokens) for i, r in enumerate(requests)]
    checker = ChunkStreamChecker(sched_requests, config.block_size) if check else None
    scheduler = make_scheduler(config)
    scheduler.add_requests(sched_requests)
    records: list[StepRecord] = []  # every step, empty ones included
    num_empty_steps = 0
    outputs: dict[int, tuple[int, ...]] = {}
    while scheduler.has_unfinished():
        output = scheduler.schedule()
        num_empty_steps = num_empty_steps + 1 if output.is_empty else 0
        if num_empty_steps > MAX_EMPTY_STEPS:
            raise RuntimeError(f"policy {config.policy!r} stalled: {MAX_EMPTY_STEPS} empty steps "
                               "with work left")
        if on_output is not None:
            on_output(output)
        seen = checker.check_step(output) if checker is not None else None
        sampled, finish = _fake_sample(output, seen, sched_requests)
        for request_id, token_id in sampled.items():  # read at once: the simulator runs at depth 0
            sched_requests[request_id].output_token_ids.append(token_id)
        finished = scheduler.update(output, finish)
        if checker is not None:
            checker.record(sampled, [f.request_id for f in finished])
        for item in finished:
            if item.request_id in outputs:
                raise RuntimeError(f"request {item.request_id} finished twice")
            outputs[item.request_id] = tuple(sched_requests[item.request_id].output_token_ids)
        records.append(StepRecord.from_output(output, cost_model.step_time_s(output)))
    steps = [record for record in records if record.num_tokens]
    trace = None
    if trace_label is not None:
        trace = Trace(config.policy, config.max_num_batched_tokens, config.num_kv_blocks, config.block_size,
                      trace_label, steps)
    return _result(requests, config, len(outputs), records, steps), trace, outputs


def _fake_sample(output: SchedulerOutput, seen: dict | None, requests: list[SchedRequest]
                 ) -> tuple[dict[int, int], dict[int, str]]:
    """Request r's i-th token is fake_token(r, i), or with the checker a hash of the KV it read;
    a request finishes at its max_tokens."""
    sampled: dict[int, int] = {}
    finish: dict[int, str] = {}
    for chunk in output.chunks:
        if not chunk.sample:
            continue
        rid = chunk.seq_id
        index = len(requests[rid].output_token_ids)  # every earlier token was read (appended)
        sampled[rid] = hash(seen[rid]) % FAKE_VOCAB_SIZE if seen is not None else fake_token(rid, index)
        if index + 1 >= requests[rid].max_tokens:
            finish[rid] = "length"
    return sampled, finish


def _result(requests: Sequence[SimRequest], config: SchedulerConfig, num_finished: int,
            records: list[StepRecord], steps: list[StepRecord]) -> SimResult:
    """records: every step; steps: those with tokens (the ones counted as steps)."""
    logical = sum(len(r.prompt_token_ids) for r in requests)
    processed = sum(r.num_distinct_tokens + r.num_prefix_tokens for r in records)
    total_tokens = sum(step.num_tokens for step in steps)
    peak_blocks = max((r.num_used_blocks for r in records), default=0)
    return SimResult(
        policy=config.policy,
        num_requests=len(requests),
        finished_requests=num_finished,
        steps=len(steps),
        total_tokens=total_tokens,
        mean_tokens_per_step=total_tokens / len(steps) if steps else 0.0,
        valley_steps=sum(step.num_tokens < config.max_num_batched_tokens / 2 for step in steps),
        logical_prefill_tokens=logical,
        processed_prefill_tokens=processed,
        saving_ratio=(logical - processed) / logical if logical else 0.0,
        decode_tokens=sum(r.num_decode_tokens for r in records),
        peak_kv_blocks=peak_blocks,
        peak_kv_tokens=peak_blocks * config.block_size,
        preemptions=sum(r.num_preempted_requests for r in records),
        estimated_time_s=sum(step.step_time_s for step in steps),
        max_num_batched_tokens=config.max_num_batched_tokens,
        num_kv_blocks=config.num_kv_blocks,
        block_size=config.block_size,
    )
