"""Per-request scheduling state and update(), shared by every policy (torch-free)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from batchllm.sched.block_pool import BlockPool
from batchllm.sched.config import SchedulerConfig
from batchllm.sched.interface import NO_GROUP, ChunksBuilder, FinishedRequest, SchedRequest, SchedulerOutput


@dataclass(eq=False)
class SeqState:
    """A request's own tokens and KV blocks, and how much of its block-table row the runner holds.

    Own tokens are the prompt after `prompt_offset` (the leading tokens stored in a group's
    shared prefix blocks; 0 when the request shares nothing), then the generated tokens. A
    prefix-cache hit of the baselines counts as own: its blocks lead the request's own blocks.
    The runner's row for the request is `prefix blocks (if any) + block_ids`.

    Counts advance when a chunk is scheduled (chunk()): its KV counts as stored, and a chunk that
    samples adds an output, whose id the caller appends to request.output_token_ids once it is
    read (the outputs past those are in flight).
    """

    request: SchedRequest
    prompt_offset: int = 0
    block_ids: list[int] = field(default_factory=list)  # own KV blocks
    num_computed_tokens: int = 0  # own tokens whose KV the scheduled steps store
    num_outputs: int = 0  # generated tokens: read, or sampled by a scheduled step and in flight
    num_table_blocks_sent: int = 0  # leading entries of the runner's row that are up to date
    # The one pending token is the one this row's previous chunk sampled: the next chunk is a
    # decode row fed on the device (the runner's last-token column), no id needed.
    pending_is_last_sampled: bool = False
    num_own_prompt_tokens: int = field(init=False)  # the prompt after prompt_offset (fixed)

    def __post_init__(self) -> None:
        self.num_own_prompt_tokens = len(self.request.prompt_token_ids) - self.prompt_offset

    @property
    def num_own_tokens(self) -> int:
        return self.num_own_prompt_tokens + self.num_outputs

    @property
    def num_pending_tokens(self) -> int:
        return self.num_own_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        return self.num_outputs > 0 and self.num_pending_tokens == 1

    def drop_blocks(self) -> list[int]:
        """The KV is gone (preempted or finished): returns the own blocks for the caller to
        free; nothing is stored any more and the runner drops the row."""
        block_ids = self.block_ids
        self.block_ids = []
        self.num_computed_tokens = 0
        self.num_table_blocks_sent = 0
        self.pending_is_last_sampled = False
        return block_ids

    def token_ids(self, start: int, end: int) -> tuple[int, ...]:
        """Ids of the request's positions [start, end) (prompt, then generated): only ids already read."""
        request = self.request
        num_prompt = len(request.prompt_token_ids)
        if start >= num_prompt:
            output_token_ids = request.output_token_ids
            if end - num_prompt > len(output_token_ids):
                raise AssertionError(f"request {request.request_id}: position {end - 1} scheduled as an input "
                                     f"before its id was read")
            return tuple(output_token_ids[start - num_prompt:end - num_prompt])
        if end <= num_prompt:
            return tuple(request.prompt_token_ids[start:end])
        return tuple(request.prompt_token_ids[start:]) + self.token_ids(num_prompt, end)

    def replace_block(self, index: int, block_id: int) -> None:
        """Own block `index` becomes `block_id` (same content); the runner's row is re-sent from there."""
        self.block_ids[index] = block_id
        self.num_table_blocks_sent = min(self.num_table_blocks_sent, index)

    def chunk(self, builder: ChunksBuilder, num_tokens: int, prefix_block_ids: Sequence[int] = (),
              group_id: int = NO_GROUP) -> None:
        """Add the next num_tokens own tokens as a chunk to builder, with the change that brings the
        runner's row (prefix_block_ids, then the own blocks) up to date (docs/design.md); counts it
        as run."""
        start = self.num_computed_tokens
        first = self.prompt_offset + start
        block_ids_start = self.num_table_blocks_sent
        num_prefix_blocks = len(prefix_block_ids)
        if block_ids_start >= num_prefix_blocks:
            new_block_ids = self.block_ids[block_ids_start - num_prefix_blocks:]
        else:
            new_block_ids = list(prefix_block_ids[block_ids_start:]) + self.block_ids
        self.num_table_blocks_sent = num_prefix_blocks + len(self.block_ids)
        sample = start + num_tokens == self.num_own_tokens
        token_ids = () if self.pending_is_last_sampled else self.token_ids(first, first + num_tokens)
        builder.add(self.request.request_id, token_ids, first, num_tokens, new_block_ids, block_ids_start,
                    self.prompt_offset, False, sample, group_id, self.is_decoding)
        self.num_computed_tokens += num_tokens
        if sample:
            self.num_outputs += 1
        self.pending_is_last_sampled = sample


class PolicyBase:
    """What every policy shares: the block pool, the unfinished requests by id and update()."""

    pool_class: type = BlockPool

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.pool = self.pool_class(config.num_kv_blocks, config.block_size)
        self._seqs: dict[int, SeqState] = {}  # unfinished requests
        self.step_index = 0
        self.finished_seq_ids: list[int] = []  # since the last step: the runner drops their rows

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def update(self, output: SchedulerOutput, finish_reasons: dict[int, str]) -> list[FinishedRequest]:
        """Scheduler.update (interface.py)."""
        finished: list[FinishedRequest] = []
        chunks = output.chunks
        for seq_id in chunks.seq_ids[~chunks.is_prefix].tolist():
            seq = self._seqs[seq_id]
            self._stored(seq)
            reason = finish_reasons.get(seq_id)
            if reason is not None:
                del self._seqs[seq_id]
                self.finished_seq_ids.append(seq_id)
                finished.append(FinishedRequest(seq_id, reason, self._finish(seq)))
        self.step_index += 1
        return finished

    def _stored(self, seq: SeqState) -> None:
        """After a step with a chunk of seq's tokens is launched (the ids of its inputs are read)."""

    def _finish(self, seq: SeqState) -> int:
        """Free a finished request's blocks; returns its prompt tokens whose KV was reused."""
        raise NotImplementedError
