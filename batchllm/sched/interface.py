"""The contract between a scheduling policy (torch-free) and the model runner: the chunks of a
step, their KV addressing and block-table changes are specified in docs/design.md."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

NO_GROUP = -1


@dataclass(frozen=True)
class ScheduledChunk:
    """One contiguous run of query rows in a step. shared_kv_len, is_prefix and group_id stay the
    same for a seq id from its first chunk until the step that drops its row."""

    seq_id: int  # request id, or a group prefix id when is_prefix
    token_ids: tuple[int, ...]  # input ids of the rows
    start_position: int  # position of the first row
    new_block_ids: tuple[int, ...]  # block-table change: row[block_ids_start:] = new_block_ids
    block_ids_start: int = 0
    shared_kv_len: int = 0  # leading KV positions held in shared (read-only) prefix blocks
    is_prefix: bool = False  # rows are a group's common-prefix tokens: nothing is sampled
    sample: bool = False  # sample the next token from the last row
    group_id: int = NO_GROUP  # prefix-sharing group, NO_GROUP when the chunk shares nothing
    is_decode: bool = False  # a single generated token being fed back

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def kv_len(self) -> int:
        """KV positions visible to the last row after this step's KV is stored."""
        return self.start_position + len(self.token_ids)


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
        return sum(len(c.token_ids) for c in self.chunks)

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
    output_token_ids: tuple[int, ...]
    finish_reason: str  # "stop" | "length" | "error"
    num_cached_prompt_tokens: int = 0  # prompt tokens whose KV was reused, not computed


class Scheduler(Protocol):
    """What every policy (batchllm, vllm, sglang, simple) implements."""

    def add_requests(self, requests: list["SchedRequest"]) -> None:
        """Hand over a batch. Policies that plan globally (batchllm) plan over each batch."""
        ...

    def has_unfinished(self) -> bool: ...

    def schedule(self) -> SchedulerOutput: ...

    def update(
        self,
        output: SchedulerOutput,
        sampled_token_ids: dict[int, int],
        finish_reasons: dict[int, str],
        resolved_token_ids: Sequence[tuple[int, int, int]] = (),
    ) -> list[FinishedRequest]:
        """The one way a step's results reach the scheduler, after each schedule():
        1. resolved_token_ids: (request_id, output index, token id) of tokens whose ids were not
           known at their own update: write each over the placeholder the request holds at
           that index (skip requests that have finished);
        2. append each sampled token of a chunk that samples: a real id, or a placeholder
           -(row + 1) while the id is still on the device (engine/placeholders.py);
        3. finish the requests named in finish_reasons (decided by the engine: EOS, stop
           ids/strings, max_tokens, "error"), free their blocks, return them."""
        ...


@dataclass
class SchedRequest:
    """A request as the scheduler sees it: ints only."""

    request_id: int
    prompt_token_ids: list[int]
    max_tokens: int
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
