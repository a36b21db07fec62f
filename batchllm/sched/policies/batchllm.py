"""`batchllm` policy: prefix-group scheduling, R_group reordering and memory-centric token
batching (BatchLLM section 4.3); its admission reservation and preemption order are explained in
docs/design.md ("Scheduling"). A group's common prefix is stored once in read-only prefix blocks;
each member's own tokens (distinct prompt, then generated) continue at position len(prefix) in
its own blocks."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from batchllm.sched.config import SchedulerConfig
from batchllm.sched.interface import NO_GROUP, ScheduledChunk, SchedRequest, SchedulerOutput
from batchllm.sched.seq_state import PolicyBase, SeqState


@dataclass(eq=False)
class _Member(SeqState):
    """Own tokens: the distinct prompt (>= 1 token; prompt_offset = the group prefix length), then the
    generated tokens, stored from position len(prefix) in the own blocks."""

    group: "_Group" = field(kw_only=True)
    waiting: bool = False  # preempted or deferred at admission: recompute when resumed
    finished: bool = False

    @property
    def is_running(self) -> bool:
        return self.group.active and not (self.finished or self.waiting)


@dataclass(eq=False)
class _Group:
    group_id: int
    prefix_token_ids: tuple[int, ...]  # empty: singleton, shares nothing
    members: list[_Member] = field(default_factory=list)
    prefix_block_ids: list[int] = field(default_factory=list)
    prefix_num_computed: int = 0
    num_prefix_blocks_sent: int = 0  # leading entries of the runner's prefix row that are up to date
    r_group: float = 0.0  # BatchLLM Eq. 3-4
    active: bool = False  # admitted (its prefix blocks are, or are being, stored)

    @property
    def prefix_id(self) -> int:
        return -(self.group_id + 1)  # never collides with request ids (>= 0)

    @property
    def prefix_done(self) -> bool:
        return self.prefix_num_computed == len(self.prefix_token_ids)


class BatchLLMScheduler(PolicyBase):
    """config.max_num_seqs is ignored on purpose: BatchLLM 4.3.3 caps a step by tokens and KV
    memory, never by the number of requests."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        threshold = config.kv_memory_threshold if config.kv_memory_threshold is not None else 1.0
        self.threshold_blocks = max(1, int(threshold * config.num_kv_blocks))  # M_threshold (BatchLLM 4.3.3)
        self.pending_groups: deque[_Group] = deque()  # not admitted, best R_group first
        self.active_groups: list[_Group] = []  # admitted, in admission order
        self._next_group_id = 0

    def add_requests(self, requests: list[SchedRequest]) -> None:
        """Plan prefix-sharing groups over this batch (BatchLLM 4.2) and queue them."""
        if not requests:
            return
        from batchllm.prefix.planner import plan_prefix_groups

        for request in requests:
            if request.request_id < 0 or request.request_id in self._seqs:
                raise ValueError(f"request ids must be unique and >= 0, got {request.request_id}")
        plan = plan_prefix_groups([r.prompt_token_ids for r in requests])
        groups = []
        for planned in plan.groups:
            group = _Group(self._next_group_id, tuple(planned.prefix_token_ids))
            self._next_group_id += 1
            num_prefix = len(group.prefix_token_ids)
            for index in planned.request_indices:
                request = requests[index]
                member = _Member(request, num_prefix, group=group)
                self._check_fits(group, member)
                group.members.append(member)
                self._seqs[request.request_id] = member
            prefill = len(group.prefix_token_ids) + sum(m.num_own_prompt_tokens for m in group.members)
            group.r_group = sum(m.request.max_tokens for m in group.members) / prefill  # Eq. 3 per group
            groups.append(group)
        # BatchLLM 4.3.2: larger R_group first (decode-heavy groups early, so that later long
        # prefills mix with their decodes). Stable: input order among equals.
        groups.sort(key=lambda g: -g.r_group)
        self.pending_groups.extend(groups)

    def schedule(self) -> SchedulerOutput:
        step = _Step(budget=self.config.max_num_batched_tokens)
        # Queue 1: decode tokens (BatchLLM 4.3.1: decodes first so they mix with prefills).
        for member in list(self._running_members()):
            if step.budget <= 0:
                break
            if not member.is_decoding or not member.is_running:
                continue
            if self._grow_or_preempt(member, step):
                step.add_member(member, 1)
        # Queue 2: distinct-prompt chunks of active requests (including recomputation), so
        # active requests finish before new ones start.
        for group in list(self.active_groups):
            if step.budget <= 0:
                break
            if group.prefix_done:
                self._schedule_distinct(group, step)
        # Queue 3: common-prefix chunks: unfinished prefixes of admitted groups, then new
        # groups in R_group order. A prefix completed in this step lets its members' distinct
        # chunks follow right away (prefix no later than its first distinct chunk).
        for group in list(self.active_groups):
            if step.budget <= 0:
                break
            if not group.prefix_done and group.group_id not in step.prefix_tokens:
                self._schedule_prefix(group, step)
        while step.budget > 0 and self.pending_groups and not self._any_waiting_member():
            if not self._admit(self.pending_groups[0], force=not self._anything_running()):
                break
            group = self.pending_groups.popleft()
            self._schedule_prefix(group, step)
        return self._build_output(step)

    # -- admission and reservation ----------------------------------------------------

    def _member_need_blocks(self, member: _Member) -> int:
        reserved_decode = int(self.config.decode_reserve_ratio * member.request.max_tokens + 0.999999)
        num_tokens = max(member.num_own_tokens, member.num_own_prompt_tokens + reserved_decode)
        return self.pool.blocks_for_tokens(num_tokens)

    def _committed_blocks(self) -> int:
        """Used blocks + the growth already promised to running requests and prefixes."""
        committed = self.pool.num_used_blocks
        for group in self.active_groups:
            committed += self.pool.blocks_for_tokens(len(group.prefix_token_ids)) - len(group.prefix_block_ids)
            for member in group.members:
                if member.is_running:
                    committed += max(0, self._member_need_blocks(member) - len(member.block_ids))
        return committed

    def _check_fits(self, group: _Group, member: _Member) -> None:
        own_num_tokens = member.num_own_prompt_tokens + member.request.max_tokens
        num_tokens = len(group.prefix_token_ids) + own_num_tokens
        num_prefix_blocks = self.pool.blocks_for_tokens(len(group.prefix_token_ids))
        needed = num_prefix_blocks + self.pool.blocks_for_tokens(own_num_tokens)
        if needed > self.threshold_blocks:
            raise ValueError(
                f"request {member.request.request_id} needs {needed} KV blocks at full length "
                f"({num_tokens} tokens incl. max_tokens), M_threshold allows {self.threshold_blocks}"
            )

    def _admit(self, group: _Group, force: bool) -> bool:
        """Start a group if its prefix + at least its first member fit the reservation;
        members beyond what fits are deferred (they start as memory frees, before any new
        group). force: nothing is running, start it regardless (progress guarantee)."""
        room = self.threshold_blocks - self._committed_blocks()
        room -= self.pool.blocks_for_tokens(len(group.prefix_token_ids))
        first_need = self._member_need_blocks(group.members[0])
        if room < first_need and not force:
            return False
        for member in group.members:
            need = self._member_need_blocks(member)
            if need <= room or member is group.members[0]:
                room -= need
            else:
                member.waiting = True
        group.active = True
        self.active_groups.append(group)
        return True

    def _any_waiting_member(self) -> bool:
        return any(m.waiting for g in self.active_groups for m in g.members)

    def _anything_running(self) -> bool:
        return any(m.is_running for g in self.active_groups for m in g.members)

    def _running_members(self):
        for group in self.active_groups:
            for member in group.members:
                if member.is_running:
                    yield member

    # -- building a step ----------------------------------------------------------------

    def _schedule_distinct(self, group: _Group, step: "_Step") -> None:
        for member in group.members:
            if step.budget <= 0:
                return
            if member.finished or id(member) in step.scheduled:
                continue
            if member.waiting:
                if member.request.request_id in step.preempted:
                    continue  # never resume in the step that preempted it (no ping-pong)
                fits = self._committed_blocks() + self._member_need_blocks(member) <= self.threshold_blocks
                if not fits and self._anything_running():
                    continue
                member.waiting = False  # resume: recompute distinct + generated tokens
            if member.num_pending_tokens <= 0 or member.is_decoding:
                continue
            room = self._room_tokens(member.block_ids, member.num_computed_tokens)
            num_tokens = min(member.num_pending_tokens, step.budget, room)
            if num_tokens <= 0:
                return  # memory full for prefill this step (BatchLLM 4.3.3)
            self._grow(member.block_ids, member.num_computed_tokens + num_tokens)
            step.add_member(member, num_tokens)

    def _schedule_prefix(self, group: _Group, step: "_Step") -> None:
        remaining = len(group.prefix_token_ids) - group.prefix_num_computed
        if remaining > 0:
            room = self._room_tokens(group.prefix_block_ids, group.prefix_num_computed)
            num_tokens = min(remaining, step.budget, room)
            if num_tokens <= 0:
                return
            self._grow(group.prefix_block_ids, group.prefix_num_computed + num_tokens)
            step.add_prefix(group, num_tokens)
            if num_tokens < remaining:
                return
        # Prefix stored by the end of this step's KV write: its distinct chunks may follow.
        if step.budget > 0:
            self._schedule_distinct(group, step)

    def _room_tokens(self, block_ids: list[int], num_computed_tokens: int) -> int:
        """Tokens that fit in block_ids and the blocks left under M_threshold."""
        free_blocks = max(0, self.threshold_blocks - self.pool.num_used_blocks)
        return (len(block_ids) + free_blocks) * self.pool.block_size - num_computed_tokens

    def _grow(self, block_ids: list[int], num_tokens: int) -> None:
        needed = self.pool.blocks_for_tokens(num_tokens) - len(block_ids)
        if needed > 0:
            block_ids.extend(self.pool.allocate(needed))

    def _grow_or_preempt(self, member: _Member, step: "_Step") -> bool:
        """Room for one more decode token of `member` under M_threshold, preempting if need be."""
        while True:
            needed = self.pool.blocks_for_tokens(member.num_computed_tokens + 1) - len(member.block_ids)
            if needed <= 0 or self.pool.num_used_blocks + needed <= self.threshold_blocks:
                self._grow(member.block_ids, member.num_computed_tokens + 1)
                return True
            victim = self._pick_victim_member(member, step)
            if victim is not None:
                self._preempt_member(victim, step)
                continue
            victim_group = self._pick_victim_group(member, step)
            if victim_group is not None:
                self._preempt_group(victim_group, step)
                continue
            self._preempt_member(member, step)
            return False

    def _pick_victim_member(self, requester: _Member, step: "_Step") -> _Member | None:
        for group in reversed(self.active_groups):
            for member in reversed(group.members):
                if (member is not requester and member.is_running and member.block_ids
                        and id(member) not in step.scheduled):
                    return member
        return None

    def _pick_victim_group(self, requester: _Member, step: "_Step") -> _Group | None:
        for group in reversed(self.active_groups):
            if (group is not requester.group and group.prefix_block_ids
                    and not any(id(m) in step.scheduled for m in group.members)):
                return group
        return None

    def _preempt_member(self, member: _Member, step: "_Step") -> None:
        step.preempted.append(member.request.request_id)
        self.pool.free(member.drop_blocks())
        member.waiting = True

    def _preempt_group(self, group: _Group, step: "_Step") -> None:
        """Whole group back to the head of the queue; its prefix is recomputed later."""
        for member in group.members:
            if member.finished:
                continue
            if member.block_ids or member.is_running:
                step.preempted.append(member.request.request_id)
            self.pool.free(member.drop_blocks())
            member.waiting = False
        self._free_prefix(group)
        group.prefix_num_computed = 0
        group.members = [m for m in group.members if not m.finished] or group.members
        self.pending_groups.appendleft(group)

    def _finish(self, member: _Member) -> int:
        group = member.group
        self.pool.free(member.drop_blocks())
        member.finished = True
        # Every member but the first reused the prefix KV instead of computing it.
        num_cached = len(group.prefix_token_ids) if member is not group.members[0] else 0
        if all(m.finished for m in group.members):
            # BatchLLM 4.3.1: the prefix's memory is released as soon as its group is done.
            self._free_prefix(group)
        return num_cached

    def _free_prefix(self, group: _Group) -> None:
        """The group leaves the active list and its prefix blocks are freed (the runner drops the row)."""
        self.pool.free(group.prefix_block_ids)
        group.prefix_block_ids = []
        if group.num_prefix_blocks_sent:
            self.finished_seq_ids.append(group.prefix_id)
            group.num_prefix_blocks_sent = 0
        group.active = False
        self.active_groups.remove(group)

    def _build_output(self, step: "_Step") -> SchedulerOutput:
        # Rows group by group (BatchLLM 5): a group's prefix chunk, then its members' chunks.
        chunks: list[ScheduledChunk] = []
        for group in step.group_order:
            prefix_tokens = step.prefix_tokens.get(group.group_id, 0)
            if prefix_tokens:
                start = group.prefix_num_computed
                blocks_sent = group.num_prefix_blocks_sent
                group.num_prefix_blocks_sent = len(group.prefix_block_ids)
                chunks.append(
                    ScheduledChunk(
                        seq_id=group.prefix_id,
                        token_ids=group.prefix_token_ids[start:start + prefix_tokens],
                        start_position=start,
                        num_tokens=prefix_tokens,
                        new_block_ids=tuple(group.prefix_block_ids[blocks_sent:]),
                        block_ids_start=blocks_sent,
                        is_prefix=True,
                        group_id=group.group_id,
                    )
                )
                group.prefix_num_computed += prefix_tokens  # counted as stored from this step on
            group_id = group.group_id if group.prefix_token_ids else NO_GROUP
            for member, num_tokens in step.member_tokens.get(group.group_id, ()):
                chunks.append(member.chunk(num_tokens, group.prefix_block_ids, group_id))
        finished, self.finished_seq_ids = self.finished_seq_ids, []
        return SchedulerOutput.from_chunks(self.step_index, chunks, sum(1 for _ in self._running_members()),
                                           self.pool.num_used_blocks, step.preempted, finished)


@dataclass
class _Step:
    """What one step has taken so far."""

    budget: int  # tokens left (N_chunk)
    group_order: list[_Group] = field(default_factory=list)
    member_tokens: dict[int, list[tuple[_Member, int]]] = field(default_factory=dict)
    prefix_tokens: dict[int, int] = field(default_factory=dict)
    scheduled: set[int] = field(default_factory=set)  # id(member)
    preempted: list[int] = field(default_factory=list)

    def _touch(self, group: _Group) -> None:
        if group.group_id not in self.member_tokens:
            self.member_tokens[group.group_id] = []
            self.group_order.append(group)

    def add_member(self, member: _Member, num_tokens: int) -> None:
        self._touch(member.group)
        self.member_tokens[member.group.group_id].append((member, num_tokens))
        self.scheduled.add(id(member))
        self.budget -= num_tokens

    def add_prefix(self, group: _Group, num_tokens: int) -> None:
        self._touch(group)
        self.prefix_tokens[group.group_id] = num_tokens
        self.budget -= num_tokens
