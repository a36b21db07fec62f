"""The contract between a scheduling policy (torch-free) and the model runner: the chunks of a
step, their KV addressing and block-table changes are specified in docs/design.md."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

NO_GROUP = -1


@dataclass(frozen=True)
class ScheduledChunk:
    """One contiguous run of query rows in a step. shared_kv_len, is_prefix and group_id stay the
    same for a seq id from its first chunk until the step that drops its row."""

    seq_id: int  # request id, or a group prefix id when is_prefix
    # Input ids of the rows, num_tokens of them; () for a decode row fed on the device: its input
    # is the token its seq's previous chunk sampled, which the runner keeps (docs/design.md).
    token_ids: tuple[int, ...]
    start_position: int  # position of the first row
    num_tokens: int  # rows
    new_block_ids: tuple[int, ...]  # block-table change: row[block_ids_start:] = new_block_ids
    block_ids_start: int = 0
    shared_kv_len: int = 0  # leading KV positions held in shared (read-only) prefix blocks
    is_prefix: bool = False  # rows are a group's common-prefix tokens: nothing is sampled
    sample: bool = False  # sample the next token from the last row
    group_id: int = NO_GROUP  # prefix-sharing group, NO_GROUP when the chunk shares nothing
    is_decode: bool = False  # one generated token fed back (its id carried only when recomputed)

    @property
    def kv_len(self) -> int:
        """KV positions visible to the last row after this step's KV is stored."""
        return self.start_position + self.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    step_index: int
    chunks: tuple[ScheduledChunk, ...]
    num_decode_tokens: int = 0
    num_distinct_tokens: int = 0  # request-owned prompt tokens (incl. recomputed ones)
    num_prefix_tokens: int = 0  # group common-prefix tokens
    num_running_requests: int = 0
    num_used_blocks: int = 0
    preempted_request_ids: tuple[int, ...] = ()
    # Requests finished since the previous step, and group prefixes (seq_id < 0) whose blocks
    # were freed (group finished or preempted): the runner drops their rows.
    finished_seq_ids: tuple[int, ...] = ()

    @property
    def dropped_seq_ids(self) -> tuple[int, ...]:
        """Rows the runner drops before applying this step's changes."""
        return self.preempted_request_ids + self.finished_seq_ids

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @classmethod
    def from_chunks(cls, step_index: int, chunks: list[ScheduledChunk], num_running_requests: int,
                    num_used_blocks: int, preempted_request_ids=(), finished_seq_ids=()) -> "SchedulerOutput":
        """The step with its token counts derived from the chunks' kinds (decode / prefix / distinct)."""
        num_decode = num_distinct = num_prefix = 0
        for chunk in chunks:
            if chunk.is_decode:
                num_decode += chunk.num_tokens
            elif chunk.is_prefix:
                num_prefix += chunk.num_tokens
            else:
                num_distinct += chunk.num_tokens
        return cls(step_index, tuple(chunks), num_decode, num_distinct, num_prefix, num_running_requests,
                   num_used_blocks, tuple(preempted_request_ids), tuple(finished_seq_ids))

    @property
    def is_empty(self) -> bool:
        return not self.chunks


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

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
