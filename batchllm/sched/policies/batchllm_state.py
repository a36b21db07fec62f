"""The batchllm policy's state: its groups (Python objects, one per prefix-sharing group) and its
members as columns (numpy, one entry per request), so that a step advances every decode row with
a few array operations. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from batchllm.sched.chunks import count_offsets
from batchllm.sched.interface import SchedRequest

# Order of running members: by their group's admission rank, then their place in the group.
RANK_SHIFT = 32


@dataclass(eq=False)
class Group:
    """A prefix-sharing group: its common prefix is stored once in read-only prefix blocks; each
    member's own tokens (distinct prompt, then generated) continue at position len(prefix)."""

    group_id: int  # also its index in the policy's list of groups
    prefix_token_ids: tuple[int, ...]  # empty: singleton, shares nothing
    members: list[int] = field(default_factory=list)  # member slots, in planning order
    prefix_block_ids: list[int] = field(default_factory=list)
    prefix_num_computed: int = 0
    num_prefix_blocks_sent: int = 0  # leading entries of the runner's prefix row that are up to date
    r_group: float = 0.0  # BatchLLM Eq. 3-4
    rank: int = -1  # admission order (a group admitted again gets a new one)
    num_unfinished: int = 0  # members not finished
    lone: bool = False  # one request that shares no prefix (set once its members are added)
    # Members with own prompt work: waiting (deferred or preempted), or running with prompt
    # tokens to compute. Decoding and finished members are never in it.
    work: set[int] = field(default_factory=set)

    @property
    def prefix_id(self) -> int:
        return -(self.group_id + 1)  # never collides with request ids (>= 0)

    @property
    def prefix_done(self) -> bool:
        return self.prefix_num_computed == len(self.prefix_token_ids)

    @property
    def chunk_group_id(self) -> int:
        """The group id its members' chunks carry (NO_GROUP when it shares nothing)."""
        return self.group_id if self.prefix_token_ids else -1


_INT_FIELDS = ("request_id", "group", "index", "prompt_offset", "num_own_prompt_tokens", "max_tokens",
               "reserved_decode_tokens", "num_computed_tokens", "num_outputs", "num_table_blocks_sent",
               "num_row_prefix_blocks", "num_blocks", "key", "scheduled_stamp", "chunk_group_id",
               "block_region_start", "block_region_size")
_BOOL_FIELDS = ("last_sampled", "waiting", "finished", "running", "lone")


class Members:
    """One entry per request (a member slot), in the order requests were added.

    Own tokens are the prompt after prompt_offset (the group prefix length), then the generated
    tokens. num_computed_tokens and num_outputs advance when a chunk is scheduled: its KV counts
    as stored, and a chunk that samples adds an output whose id the caller appends to the
    request's output_token_ids once read. num_table_blocks_sent: leading entries of the runner's
    row (prefix blocks, then own blocks) that are up to date; num_row_prefix_blocks: the prefix
    blocks of that row. last_sampled: the one pending token is the one this row's previous chunk
    sampled (a decode row fed on the device). A member's own blocks (num_blocks of them) hold
    exactly its computed own tokens, ceil(num_computed_tokens / block size); they are the first
    num_blocks entries of its region of own_block_ids (sized by the policy when added, moved to one
    twice the size should it outgrow it): a step's growth is one scatter, a finish one ranged gather. A member is running
    when its group is admitted and it is neither waiting nor finished; lone: its group is it
    alone and shares nothing (Group.lone); key orders running members (group rank, place in group);
    scheduled_stamp marks the members scheduled in the current step."""

    def __init__(self) -> None:
        self.size = 0
        for name in _INT_FIELDS:
            setattr(self, name, np.zeros(0, dtype=np.int64))
        for name in _BOOL_FIELDS:
            setattr(self, name, np.zeros(0, dtype=bool))
        self.own_block_ids = np.zeros(0, dtype=np.int64)  # every member's region of own KV blocks
        self.num_region_blocks = 0  # entries of own_block_ids given to regions
        self.requests: list[SchedRequest] = []
        # Each unfinished member's prompt as an integer array (the one the planner read): a chunk's
        # input ids are slices of it (a list of Python ints costs ~35 ns a token to convert).
        self.prompt_arrays: list[np.ndarray | None] = []
        # The fixed fields of each member as Python ints, for the per-member paths (a numpy
        # scalar costs a few times a list item): (request_id, group, prompt_offset,
        # num_own_prompt_tokens, reserved_decode_tokens, chunk_group_id).
        self.info: list[tuple[int, int, int, int, int, int]] = []

    def add(self, request: SchedRequest, group: Group, prompt_offset: int, reserved_decode_tokens: int,
            prompt_array: np.ndarray, num_region_blocks: int) -> int:
        """A new member of group (not yet running); returns its slot. prompt_array: the request's
        prompt_token_ids as a 1-D integer array; num_region_blocks: own blocks it may hold (at
        its full length)."""
        slot = self.size
        if slot == self.request_id.shape[0]:
            self._grow(max(16, 2 * slot))
        self.size += 1
        self.request_id[slot] = request.request_id
        self.group[slot] = group.group_id
        self.index[slot] = len(group.members)
        self.prompt_offset[slot] = prompt_offset
        self.num_own_prompt_tokens[slot] = len(request.prompt_token_ids) - prompt_offset
        self.max_tokens[slot] = request.max_tokens
        self.reserved_decode_tokens[slot] = reserved_decode_tokens
        self.scheduled_stamp[slot] = -1
        self.chunk_group_id[slot] = group.chunk_group_id
        self.block_region_start[slot] = self._new_region(num_region_blocks)
        self.block_region_size[slot] = num_region_blocks
        self.requests.append(request)
        self.prompt_arrays.append(prompt_array)
        self.info.append((request.request_id, group.group_id, prompt_offset,
                          len(request.prompt_token_ids) - prompt_offset, reserved_decode_tokens, group.chunk_group_id))
        return slot

    def _grow(self, capacity: int) -> None:
        for name in (*_INT_FIELDS, *_BOOL_FIELDS):
            old = getattr(self, name)
            grown = np.zeros(capacity, dtype=old.dtype)
            grown[:old.shape[0]] = old
            setattr(self, name, grown)

    def _new_region(self, num_blocks: int) -> int:
        """The start of num_blocks fresh entries of own_block_ids."""
        start = self.num_region_blocks
        self.num_region_blocks += num_blocks
        if self.num_region_blocks > self.own_block_ids.shape[0]:
            grown = np.zeros(max(1024, 2 * self.num_region_blocks), dtype=np.int64)
            grown[:start] = self.own_block_ids[:start]
            self.own_block_ids = grown
        return start

    def own_blocks(self, slot: int) -> np.ndarray:
        """The member's own block ids (a view)."""
        start = int(self.block_region_start[slot])
        return self.own_block_ids[start:start + int(self.num_blocks[slot])]

    def append_blocks(self, slots: np.ndarray, counts: np.ndarray, block_ids: np.ndarray) -> None:
        """Each of slots (distinct) takes the next counts of block_ids (flat) after its own blocks."""
        before = self.num_blocks[slots]
        ends = before + counts
        outgrown = ends > self.block_region_size[slots]
        if outgrown.any():
            for i in np.flatnonzero(outgrown).tolist():
                self._move_region(int(slots[i]), 2 * int(ends[i]))
        places = self.block_region_start[slots] + before
        if block_ids.shape[0] != slots.shape[0]:  # some take more than one: each its run of places
            places = np.repeat(places - count_offsets(counts)[:-1], counts) + np.arange(block_ids.shape[0])
        self.own_block_ids[places] = block_ids
        self.num_blocks[slots] = ends

    def _move_region(self, slot: int, num_blocks: int) -> None:
        """A fresh region for num_blocks own blocks, the member's blocks copied into it (the old
        region is not reused: moves double a region, so they at most double the entries)."""
        block_ids = self.own_blocks(slot).copy()
        start = self._new_region(num_blocks)
        self.own_block_ids[start:start + block_ids.shape[0]] = block_ids
        self.block_region_start[slot], self.block_region_size[slot] = start, num_blocks

    def release_order(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The own blocks of each of slots, each member's last one first, member after member
        (the order in which freeing each member's blocks in turn returns them), and where each
        member's blocks start in it, then the end."""
        counts = self.num_blocks[slots]
        offsets = count_offsets(counts)
        lasts = self.block_region_start[slots] + counts - 1
        places = np.repeat(lasts + offsets[:-1], counts) - np.arange(int(offsets[-1]))
        return self.own_block_ids[places], offsets

    def num_pending_tokens(self, slot: int) -> int:
        """Own tokens (prompt after the prefix, then outputs) whose KV no scheduled step stores."""
        return self.info[slot][3] + int(self.num_outputs[slot]) - int(self.num_computed_tokens[slot])

    def is_decoding(self, slot: int) -> bool:
        """An output, and exactly that one own token pending: its next chunk is a decode row."""
        num_outputs = int(self.num_outputs[slot])
        return num_outputs > 0 and self.info[slot][3] + num_outputs - int(self.num_computed_tokens[slot]) == 1

    def token_ids(self, slot: int, start: int, end: int) -> np.ndarray:
        """Ids of the request's positions [start, end) (prompt, then generated): only ids already read."""
        prompt = self.prompt_arrays[slot]
        num_prompt = prompt.shape[0]
        if end <= num_prompt:
            return prompt[start:end]
        request = self.requests[slot]
        output_token_ids = request.output_token_ids
        if end - num_prompt > len(output_token_ids):
            raise AssertionError(f"request {request.request_id}: position {end - 1} scheduled as an input "
                                 f"before its id was read")
        outputs = np.array(output_token_ids[max(0, start - num_prompt):end - num_prompt], dtype=np.int64)
        return outputs if start >= num_prompt else np.concatenate([prompt[start:], outputs])
