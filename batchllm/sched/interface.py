"""The contract between a scheduling policy (torch-free) and the model runner: the chunks of a
step, their KV addressing and block-table changes are specified in docs/design.md."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from batchllm.sched.chunks import NO_GROUP, ChunksBuilder, ScheduledChunk, ScheduledChunks

__all__ = ["NO_GROUP", "ChunksBuilder", "FinishedRequest", "SchedRequest", "ScheduledChunk", "ScheduledChunks",
           "Scheduler", "SchedulerOutput"]

@dataclass(frozen=True)
class SchedulerOutput:
    step_index: int
    # The step's chunks as columns (chunks.py); any sequence of ScheduledChunk is converted.
    chunks: ScheduledChunks
    num_decode_tokens: int = 0
    num_distinct_tokens: int = 0  # request-owned prompt tokens (incl. recomputed ones)
    num_prefix_tokens: int = 0  # group common-prefix tokens
    num_running_requests: int = 0
    num_used_blocks: int = 0
    preempted_request_ids: tuple[int, ...] = ()
    # Requests finished since the previous step, and group prefixes (seq_id < 0) whose blocks
    # were freed (group finished or preempted): the runner drops their rows.
    finished_seq_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.chunks, ScheduledChunks):
            object.__setattr__(self, "chunks", ScheduledChunks.from_chunks(self.chunks))

    @property
    def dropped_seq_ids(self) -> tuple[int, ...]:
        """Rows the runner drops before applying this step's changes."""
        return self.preempted_request_ids + self.finished_seq_ids

    @property
    def num_tokens(self) -> int:
        return int(self.chunks.num_tokens.sum())

    @classmethod
    def from_chunks(cls, step_index: int, chunks: ScheduledChunks | Sequence[ScheduledChunk], num_running_requests: int,
                    num_used_blocks: int, preempted_request_ids=(), finished_seq_ids=()) -> "SchedulerOutput":
        """The step with its token counts derived from the chunks' kinds (decode / prefix / distinct)."""
        if not isinstance(chunks, ScheduledChunks):
            chunks = ScheduledChunks.from_chunks(chunks)
        num_tokens, is_decode, is_prefix = chunks.num_tokens, chunks.is_decode, chunks.is_prefix
        num_decode = int(num_tokens[is_decode].sum())
        num_prefix = int(num_tokens[is_prefix & ~is_decode].sum())
        num_distinct = int(num_tokens.sum()) - num_decode - num_prefix
        return cls(step_index, chunks, num_decode, num_distinct, num_prefix, num_running_requests,
                   num_used_blocks, tuple(preempted_request_ids), tuple(finished_seq_ids))

    @property
    def is_empty(self) -> bool:
        return not len(self.chunks)


@dataclass(frozen=True)
class FinishedRequest:
    request_id: int
    finish_reason: str  # "stop" | "length" | "error"
    num_cached_prompt_tokens: int = 0  # prompt tokens whose KV was reused, not computed


class Scheduler(Protocol):
    """What every policy (batchllm, vllm, sglang, simple) implements. The caller runs, per step,
    schedule() -> launch the step -> update(); at most one step's samples are unread at a
    schedule() (docs/design.md, "The step loop and asynchronous scheduling").

    The scheduler keeps counts, not tokens: schedule() counts the step's KV as stored and one
    output for each chunk that samples. The ids are the caller's: each SchedRequest's
    output_token_ids is appended by the caller, once per token, when the id is read. The
    scheduler reads ids only where it needs them (a recompute's input, the prefix-cache keys of
    full blocks), and only ids already read: a decode row's input stays on the device."""

    def add_requests(self, requests: list["SchedRequest"]) -> None:
        """Hand over a batch. Policies that plan globally (batchllm) plan over each batch."""
        ...

    def has_unfinished(self) -> bool: ...

    def schedule(self) -> SchedulerOutput:
        """The next step; from here on the scheduler counts it as run."""
        ...

    def update(self, output: SchedulerOutput, finish_reasons: dict[int, str]) -> list[FinishedRequest]:
        """After each schedule(), once its step is launched and every sample of the steps before it
        has been read (appended to output_token_ids): the blocks the step filled may enter the
        prefix cache, then the requests named in finish_reasons finish (decided by the engine:
        EOS, stop ids/strings, max_tokens, "error"; only requests with a chunk in this step), their
        blocks are freed, and they are returned."""
        ...


@dataclass
class SchedRequest:
    """A request as the scheduler sees it: ints only. output_token_ids holds the generated ids read
    so far, in order: the caller's list (the engine's RequestState owns it), appended by the
    caller only; the scheduler reads it and never writes it."""

    request_id: int
    prompt_token_ids: list[int]
    max_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    # False: its prompt reuses no other request's KV (no shared prefix group, no prefix-cache hit),
    # so every prompt position runs through the model (prompt logprobs need their logits).
    share_prefix: bool = True
    # prompt_token_ids as a 1-D integer numpy array, where the caller has one: a planner that works
    # on arrays reads it rather than converting the list (about 25 ns a token)
    prompt_array: Any = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
