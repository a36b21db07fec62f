"""The chunks of every step of a bench run, replayed on the host: the engine's step records keep
only token counts per step, while the roofline (roofline.py) needs each step's KV positions.
With outputs forced to max_tokens a policy's schedule depends on the prompts, the token counts
and the scheduler settings only, so the scheduler driven by the simulator (fake tokens, no
model) makes the same steps as the run; `matches` checks that against the run's step records.
Torch-free."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from batchllm.perf.roofline import StepWork, step_work
from batchllm.sched.config import SchedulerConfig
from batchllm.sched.interface import SchedulerOutput
from batchllm.sched.simulator import SimRequest, simulate

StepCounts = tuple[int, int, int, int]  # decode, distinct and prefix tokens, KV blocks in use


def step_counts(step) -> StepCounts:
    """What a SchedulerOutput and a StepRecord both say about a step."""
    return (step.num_decode_tokens, step.num_distinct_tokens, step.num_prefix_tokens, step.num_used_blocks)


@dataclass(frozen=True)
class ReplayedSchedule:
    steps: tuple[StepWork, ...]  # every non-empty step, in order
    counts: tuple[StepCounts, ...]  # per step, for the comparison with a run

    def matches(self, records: Sequence) -> bool:
        """Whether a run's StepRecords have the same steps (token counts and KV blocks)."""
        return tuple(step_counts(record) for record in records) == self.counts


def replay_schedule(prompts: Sequence[Sequence[int]], max_tokens: Sequence[int],
                    config: SchedulerConfig) -> ReplayedSchedule:
    """Drive config's policy over the requests (request i: prompts[i], max_tokens[i]), as the
    engine does with the same settings."""
    steps: list[StepWork] = []
    counts: list[StepCounts] = []

    def record(output: SchedulerOutput) -> None:
        if output.is_empty:  # the simulator tolerates a few; the engine never runs one
            return
        steps.append(step_work(output.chunks))
        counts.append(step_counts(output))

    requests = [SimRequest(tuple(prompt), int(count)) for prompt, count in zip(prompts, max_tokens)]
    simulate(requests, config, on_output=record)
    return ReplayedSchedule(tuple(steps), tuple(counts))
