"""Per-request scheduling state shared by every policy (torch-free)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from batchllm.sched.interface import SchedRequest


@dataclass(eq=False)
class SeqState:
    """A request's own tokens and KV blocks, and how much of its block-table row the runner holds.

    Own tokens are the prompt after `prompt_offset` (the leading tokens stored in a group's
    shared prefix blocks; 0 when the request shares nothing), then the generated tokens. A
    prefix-cache hit of the baselines counts as own: its blocks lead the request's own blocks.
    The runner's row for the request is `prefix blocks (if any) + block_ids`.
    """

    request: SchedRequest
    prompt_offset: int = 0
    block_ids: list[int] = field(default_factory=list)  # own KV blocks
    num_computed_tokens: int = 0  # own tokens whose KV is stored
    num_table_blocks_sent: int = 0  # leading entries of the runner's row that are up to date
    num_own_prompt_tokens: int = field(init=False)  # the prompt after prompt_offset (fixed)

    def __post_init__(self) -> None:
        self.num_own_prompt_tokens = len(self.request.prompt_token_ids) - self.prompt_offset

    @property
    def num_own_tokens(self) -> int:
        return self.num_own_prompt_tokens + len(self.request.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        return self.num_own_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        return bool(self.request.output_token_ids) and self.num_pending_tokens == 1

    def own_token_slice(self, start: int, end: int) -> tuple[int, ...]:
        """Own tokens [start, end) without building the whole token list (decode steps)."""
        return token_slice(self.request, self.prompt_offset + start, self.prompt_offset + end)

    def drop_blocks(self) -> list[int]:
        """The KV is gone (preempted or finished): returns the own blocks for the caller to
        free; nothing is stored any more and the runner drops the row."""
        block_ids = self.block_ids
        self.block_ids = []
        self.num_computed_tokens = 0
        self.num_table_blocks_sent = 0
        return block_ids

    def replace_block(self, index: int, block_id: int) -> None:
        """Own block `index` becomes `block_id` (same content); the runner's row is re-sent from there."""
        self.block_ids[index] = block_id
        self.num_table_blocks_sent = min(self.num_table_blocks_sent, index)

    def table_change(self, prefix_block_ids: Sequence[int] = ()) -> tuple[int, tuple[int, ...]]:
        """(block_ids_start, new_block_ids) that bring the runner's row, prefix_block_ids then
        the own blocks, up to date (interface.py)."""
        start = self.num_table_blocks_sent
        num_prefix_blocks = len(prefix_block_ids)
        if start >= num_prefix_blocks:
            new_block_ids = tuple(self.block_ids[start - num_prefix_blocks:])
        else:
            new_block_ids = tuple(prefix_block_ids[start:]) + tuple(self.block_ids)
        self.num_table_blocks_sent = num_prefix_blocks + len(self.block_ids)
        return start, new_block_ids


def token_slice(request: SchedRequest, start: int, end: int) -> tuple[int, ...]:
    """request.all_token_ids[start:end] without building the whole list."""
    num_prompt = len(request.prompt_token_ids)
    if start >= num_prompt:
        return tuple(request.output_token_ids[start - num_prompt:end - num_prompt])
    if end <= num_prompt:
        return tuple(request.prompt_token_ids[start:end])
    return tuple(request.prompt_token_ids[start:]) + tuple(request.output_token_ids[:end - num_prompt])
