"""Per-step records of a run (engine or simulator) and their JSON file (torch-free)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from batchllm.sched.interface import SchedulerOutput

TRACE_FORMAT_VERSION = 1


@dataclass(frozen=True)
class StepRecord:
    step_index: int
    num_decode_tokens: int
    num_distinct_tokens: int  # request-owned prompt tokens (incl. recomputed ones)
    num_prefix_tokens: int  # group common-prefix tokens
    num_running_requests: int
    num_used_blocks: int  # KV blocks held by requests/groups after scheduling the step
    step_time_s: float  # measured (engine) or estimated by the cost model (simulator)
    num_preempted_requests: int = 0
    # Engine only: where the step's wall time went on the host. schedule: the policy;
    # launch: building inputs and enqueuing the model (asynchronous on GPU); wait: blocked on
    # the device for the sampled tokens (GPU time not hidden behind the host work).
    schedule_time_s: float = 0.0
    launch_time_s: float = 0.0
    wait_time_s: float = 0.0

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_distinct_tokens + self.num_prefix_tokens

    @staticmethod
    def from_output(output: SchedulerOutput, step_time_s: float) -> "StepRecord":
        return StepRecord(
            step_index=output.step_index,
            num_decode_tokens=output.num_decode_tokens,
            num_distinct_tokens=output.num_distinct_tokens,
            num_prefix_tokens=output.num_prefix_tokens,
            num_running_requests=output.num_running_requests,
            num_used_blocks=output.num_used_blocks,
            step_time_s=step_time_s,
            num_preempted_requests=len(output.preempted_request_ids),
        )


@dataclass
class Trace:
    policy: str
    max_num_batched_tokens: int  # N_chunk: the valley line is half of it
    num_kv_blocks: int
    block_size: int
    label: str = ""  # workload / setting, shown in plot titles
    steps: list[StepRecord] = field(default_factory=list)


def write_trace(trace: Trace, path: str) -> None:
    with open(path, "w", encoding="utf-8") as file:
        json.dump({**asdict(trace), "format_version": TRACE_FORMAT_VERSION}, file)
        file.write("\n")


def read_trace(path: str) -> Trace:
    with open(path, encoding="utf-8") as file:
        obj = json.load(file)
    try:
        steps = [StepRecord(**step) for step in obj.pop("steps")]
        obj.pop("format_version", None)
        return Trace(steps=steps, **obj)
    except (KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a batchllm step trace ({error})") from error
