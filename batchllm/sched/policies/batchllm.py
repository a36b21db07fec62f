"""`batchllm` policy: prefix-group scheduling, R_group reordering and memory-centric token
batching (BatchLLM section 4.3); its admission reservation and preemption order are explained in
docs/design.md ("Scheduling"). A group's common prefix is stored once in read-only prefix blocks;
each member's own tokens (distinct prompt, then generated) continue at position len(prefix) in
its own blocks.

A step costs what changes in it, not what runs: the running decodes advance as arrays
(batchllm_state.Members), the groups with prompt work are kept apart, and the blocks promised to
running requests are a running total."""

from __future__ import annotations

from collections import deque
from itertools import islice, takewhile
from operator import attrgetter, itemgetter

import numpy as np

from batchllm.sched.config import SchedulerConfig
from batchllm.sched.owned_block_pool import OwnedBlockPool
from batchllm.sched.interface import FinishedRequest, SchedRequest, SchedulerOutput
from batchllm.sched.policies.batchllm_output import LoneRun, Step, StepChunks
from batchllm.sched.policies.batchllm_state import RANK_SHIFT, Group, Members
from batchllm.sched.seq_state import PolicyBase

# A member's region of own block ids holds its prompt and up to this many outputs at first (then
# doubles as it outgrows it): sized at max_tokens, a request left to the context length (128k tokens
# on Llama-3.1) would hold 64 KiB of block ids from the start.
_REGION_DECODE_TOKENS = 1024
_LONE_RUN_WINDOW = 128  # pending groups _admit_lone_requests looks at in one go (64 took ~2.5 calls a step)
_NO_BLOCKS = np.zeros(0, dtype=np.int64)
_is_lone = attrgetter("lone")
_members_of = attrgetter("members")
_first_item = itemgetter(0)


def _first_members(groups: list[Group]) -> np.ndarray:
    """The first member slot of each group."""
    return np.fromiter(map(_first_item, map(_members_of, groups)), dtype=np.int64, count=len(groups))


def _fills_blocks(num_tokens: np.ndarray, block_size: int) -> np.ndarray:
    """Where num_tokens exactly fill their last block of block_size tokens (or are 0)."""
    if block_size & (block_size - 1) == 0:  # a bit mask costs a fifth of a modulo over 6,500 decode rows
        return (num_tokens & (block_size - 1)) == 0
    return num_tokens % block_size == 0


def _prompt_ids(request: SchedRequest):
    """The request's prompt as the array its caller made, else its list (converted by the planner)."""
    return request.prompt_array if request.prompt_array is not None else request.prompt_token_ids


def _compact_ids(token_ids: np.ndarray) -> np.ndarray:
    """The ids as int32 where they fit (every vocabulary does): kept until the request finishes,
    at 4 bytes a token beside the request's own list."""
    if token_ids.size and 0 <= int(token_ids.min()) and int(token_ids.max()) < 1 << 31:
        return token_ids.astype(np.int32)
    return token_ids


class BatchLLMScheduler(StepChunks, PolicyBase):
    """config.max_num_seqs is ignored on purpose: BatchLLM 4.3.3 caps a step by tokens and KV
    memory, never by the number of requests."""

    pool_class = OwnedBlockPool  # every block has one holder: its group (prefix blocks) or its member

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        threshold = config.kv_memory_threshold if config.kv_memory_threshold is not None else 1.0
        self.threshold_blocks = max(1, int(threshold * config.num_kv_blocks))  # M_threshold (BatchLLM 4.3.3)
        self.block_size = config.block_size
        self.members = Members()
        self.groups: list[Group] = []  # by group id
        self.pending_groups: deque[Group] = deque()  # not admitted, best R_group first
        self._slot_of: dict[int, int] = {}  # unfinished request id -> member slot
        # Admitted groups by rank (dicts keep admission order): those whose prefix is not stored
        # yet, those with a prefix, and those with members with prompt work.
        self._prefix_pending: dict[int, Group] = {}
        self._with_prefix: dict[int, Group] = {}
        self._with_work: dict[int, Group] = {}
        self._next_rank = 0
        self._num_running = 0
        self._num_waiting = 0
        # Blocks promised beyond those in use (docs/design.md, "Scheduling"): each active group's
        # prefix blocks still to store, each running member's reservation beyond its blocks.
        self._promised_prefix_blocks = 0
        self._promised_member_blocks = 0
        # Running members by key, as of the start of the step, and those that started running since.
        self._running_order = np.zeros(0, dtype=np.int64)
        self._started_running: list[int] = []
        self._stopped_running: list[int] = []
        self._stamp = 0  # counts schedule() calls: members.scheduled_stamp marks this step's

    @property
    def active_groups(self) -> list[Group]:
        """Admitted groups (those with a member running or waiting), in admission order."""
        members = self.members
        admitted = members.running[:members.size] | members.waiting[:members.size]
        group_ids = np.unique(members.group[:members.size][admitted]).tolist()
        return sorted((self.groups[group_id] for group_id in group_ids), key=lambda group: group.rank)

    def has_unfinished(self) -> bool:
        return bool(self._slot_of)

    def block_table(self, seq_id: int) -> tuple[int, ...]:
        """The whole row the runner holds for seq_id after the last step: a prefix's blocks, or a
        member's group prefix blocks then its own."""
        if seq_id < 0:
            return tuple(self.groups[-seq_id - 1].prefix_block_ids)
        slot = self._slot_of[seq_id]
        group = self.groups[int(self.members.group[slot])]
        return tuple(group.prefix_block_ids) + tuple(self.members.own_blocks(slot).tolist())

    def add_requests(self, requests: list[SchedRequest]) -> None:
        """Plan prefix-sharing groups over this batch (BatchLLM 4.2) and queue them."""
        if not requests:
            return
        from batchllm.prefix.planner import plan_prefix_token_arrays

        for request in requests:
            if request.request_id < 0 or request.request_id in self._slot_of:
                raise ValueError(f"request ids must be unique and >= 0, got {request.request_id}")
        sharing = [i for i, r in enumerate(requests) if r.share_prefix]
        plan, sharing_arrays = plan_prefix_token_arrays([_prompt_ids(requests[i]) for i in sharing])
        prompt_arrays: list = [None] * len(requests)
        if plan.max_token_id < 1 << 31:  # the planner checked every id is >= 0
            sharing_arrays = [array.astype(np.int32) for array in sharing_arrays]
        for i, array in zip(sharing, sharing_arrays):
            prompt_arrays[i] = array
        for i, request in enumerate(requests):
            if prompt_arrays[i] is None:
                prompt_arrays[i] = _compact_ids(np.asarray(_prompt_ids(request), dtype=np.int64))
        starts = plan.group_start.tolist()
        request_indices = [sharing[i] for i in plan.member_request_index.tolist()]
        # (members, prefix length) per group; a request that shares no prefix is a group of its own
        planned = [(request_indices[starts[index]:starts[index + 1]], prefix_len)
                   for index, prefix_len in enumerate(plan.group_prefix_num_tokens.tolist())]
        planned += [([i], 0) for i, r in enumerate(requests) if not r.share_prefix]
        ratio = self.config.decode_reserve_ratio
        groups = []
        for indices, prefix_len in planned:
            group = Group(len(self.groups), tuple(requests[indices[0]].prompt_token_ids[:prefix_len]))
            self.groups.append(group)
            max_tokens = prefill = 0
            for request_index in indices:
                request = requests[request_index]
                reserved = int(ratio * request.max_tokens + 0.999999)
                num_region_blocks = self.pool.blocks_for_tokens(len(request.prompt_token_ids) - prefix_len
                                                                + min(request.max_tokens, _REGION_DECODE_TOKENS))
                slot = self.members.add(request, group, prefix_len, reserved, prompt_arrays[request_index],
                                        num_region_blocks)
                self._check_fits(group, slot)
                group.members.append(slot)
                self._slot_of[request.request_id] = slot
                max_tokens += request.max_tokens
                prefill += len(request.prompt_token_ids) - prefix_len
            group.num_unfinished = len(group.members)
            group.lone = len(group.members) == 1 and not prefix_len
            self.members.lone[group.members[0]] = group.lone
            group.r_group = max_tokens / (prefix_len + prefill)  # Eq. 3 per group
            groups.append(group)
        # BatchLLM 4.3.2: larger R_group first (decode-heavy groups early, so that later long
        # prefills mix with their decodes). Stable: input order among equals.
        groups.sort(key=lambda g: -g.r_group)
        self.pending_groups.extend(groups)

    def schedule(self) -> SchedulerOutput:
        self._stamp += 1
        step = Step(budget=self.config.max_num_batched_tokens, stamp=self._stamp)
        # Queue 1: decode tokens (BatchLLM 4.3.1: decodes first so they mix with prefills).
        self._schedule_decodes(step)
        # Queue 2: distinct-prompt chunks of active requests (including recomputation), so
        # active requests finish before new ones start.
        for group in sorted(self._with_work.values(), key=lambda g: g.rank):
            if step.budget <= 0:
                break
            if group.prefix_done:
                self._schedule_distinct(group, step)
        # Queue 3: common-prefix chunks: unfinished prefixes of admitted groups, then new
        # groups in R_group order. A prefix completed in this step lets its members' distinct
        # chunks follow right away (prefix no later than its first distinct chunk).
        for group in list(self._prefix_pending.values()):
            if step.budget <= 0:
                break
            if group.group_id not in step.prefix_tokens:
                self._schedule_prefix(group, step)
        while step.budget > 0 and self.pending_groups and not self._num_waiting:
            if self._num_running and self._admit_lone_requests(step):
                continue
            if not self._admit(self.pending_groups[0], force=not self._num_running):
                break
            group = self.pending_groups.popleft()
            self._schedule_prefix(group, step)
        return self._build_output(step)

    # -- the running members and the blocks promised to them ---------------------------------

    def _need_blocks(self, slot: int) -> int:
        """Own blocks a member holds at its reservation: its own prompt and the reserved share
        of max_tokens, or all of its own tokens if more."""
        _, _, _, num_own_prompt, reserved, _ = self.members.info[slot]
        num_outputs = int(self.members.num_outputs[slot])
        return -(-(num_own_prompt + (num_outputs if num_outputs > reserved else reserved)) // self.block_size)

    def _promised(self, slot: int) -> int:
        """A running member's share of the promised blocks."""
        return max(0, self._need_blocks(slot) - int(self.members.num_blocks[slot]))

    def _promised_array(self, slots: np.ndarray) -> np.ndarray:
        members = self.members
        num_own_prompt = members.num_own_prompt_tokens[slots]
        num_tokens = num_own_prompt + np.maximum(members.num_outputs[slots], members.reserved_decode_tokens[slots])
        return np.maximum(0, -(-num_tokens // self.block_size) - members.num_blocks[slots])

    def _committed_blocks(self) -> int:
        """Used blocks + the growth already promised to running requests and prefixes."""
        return self.pool.num_used_blocks + self._promised_prefix_blocks + self._promised_member_blocks

    def _start_running(self, slot: int) -> None:
        members = self.members
        if members.waiting[slot]:
            members.waiting[slot] = False
            self._num_waiting -= 1
        members.running[slot] = True
        self._num_running += 1
        self._promised_member_blocks += self._promised(slot)
        self._started_running.append(slot)

    def _stop_running(self, slot: int) -> None:
        self._promised_member_blocks -= self._promised(slot)
        self.members.running[slot] = False
        self._num_running -= 1
        self._stopped_running.append(slot)

    def _set_waiting(self, slot: int, group: Group) -> None:
        if not self.members.waiting[slot]:
            self.members.waiting[slot] = True
            self._num_waiting += 1
        self._add_work(group, slot)

    def _add_work(self, group: Group, slot: int) -> None:
        group.work.add(slot)
        self._with_work[group.rank] = group

    def _discard_work(self, group: Group, slot: int) -> None:
        group.work.discard(slot)
        if not group.work:
            self._with_work.pop(group.rank, None)

    def _drop_work(self, group: Group) -> None:
        """No member of the group has prompt work any more."""
        if group.work:
            self._with_work.pop(group.rank, None)
            group.work = set()

    def _running_slots(self) -> np.ndarray:
        """The running members by key (group rank, place in group)."""
        if not (self._stopped_running or self._started_running):
            return self._running_order
        members = self.members
        order = self._running_order
        started_list, stopped = self._started_running, self._stopped_running
        self._started_running, self._stopped_running = [], []
        if stopped:
            keep = members.running[order]
            # A member that stopped and started again since holds a stale place (and key).
            restarted = set(stopped).intersection(started_list)
            if restarted:
                keep[np.isin(order, np.fromiter(restarted, dtype=np.int64))] = False
            order = order[keep]
        if started_list:
            started = np.array(sorted(set(started_list)) if len(set(started_list)) < len(started_list)
                               else started_list, dtype=np.int64)
            started = started[members.running[started]]
            keys = members.key[started]
            if keys.size > 1 and (keys[1:] < keys[:-1]).any():
                started, keys = started[np.argsort(keys, kind="stable")], np.sort(keys, kind="stable")
            if not order.size or not keys.size or keys[0] > members.key[order[-1]]:
                order = np.concatenate([order, started])
            else:
                order = np.insert(order, np.searchsorted(members.key[order], keys), started)
        self._running_order = order
        return order

    # -- admission and reservation ----------------------------------------------------

    def _check_fits(self, group: Group, slot: int) -> None:
        members = self.members
        own_num_tokens = int(members.num_own_prompt_tokens[slot] + members.max_tokens[slot])
        num_tokens = len(group.prefix_token_ids) + own_num_tokens
        num_prefix_blocks = self.pool.blocks_for_tokens(len(group.prefix_token_ids))
        needed = num_prefix_blocks + self.pool.blocks_for_tokens(own_num_tokens)
        if needed > self.threshold_blocks:
            raise ValueError(
                f"request {int(members.request_id[slot])} needs {needed} KV blocks at full length "
                f"({num_tokens} tokens incl. max_tokens), M_threshold allows {self.threshold_blocks}"
            )

    def _admit(self, group: Group, force: bool) -> bool:
        """Start a group if its prefix + at least its first member fit the reservation;
        members beyond what fits are deferred (they start as memory frees, before any new
        group). force: nothing is running, start it regardless (progress guarantee)."""
        num_prefix_blocks = self.pool.blocks_for_tokens(len(group.prefix_token_ids))
        room = self.threshold_blocks - self._committed_blocks() - num_prefix_blocks
        first = group.members[0]
        first_need = self._need_blocks(first)
        if room < first_need and not force:
            return False
        group.rank = rank = self._next_rank
        self._next_rank += 1
        if group.prefix_token_ids:
            self._with_prefix[rank] = group
        if not group.prefix_done:
            self._prefix_pending[rank] = group
        self._promised_prefix_blocks += num_prefix_blocks - len(group.prefix_block_ids)
        members = self.members
        if len(group.members) == 1:  # a request that shares nothing: the first member alone
            members.key[first] = (rank << RANK_SHIFT) + members.index[first]
            self._start_running(first)
            self._add_work(group, first)
            return True
        slots = np.array(group.members, dtype=np.int64)
        members.key[slots] = (rank << RANK_SHIFT) + members.index[slots]
        for slot in group.members:
            need = first_need if slot == first else self._need_blocks(slot)
            if need <= room or slot == first:
                room -= need
                self._start_running(slot)
                self._add_work(group, slot)
            else:
                self._set_waiting(slot, group)
        return True

    def _admit_lone_requests(self, step: "Step") -> int:
        """The admission loop over the leading pending groups that are one request sharing nothing,
        as array operations; returns how many were admitted (0: the head is not such a group, or
        does not fit). Each one is admitted as _admit would (nothing is forced: something runs) and
        its prompt scheduled as _schedule_distinct would: its own prompt is due from its start,
        and the room it reserved covers it, so the token budget alone cuts its chunk."""
        head = self.pending_groups[0]
        if not head.lone or self._committed_blocks() + self._need_blocks(head.members[0]) > self.threshold_blocks:
            return 0
        run = list(takewhile(_is_lone, islice(self.pending_groups, _LONE_RUN_WINDOW)))
        members, size = self.members, self.block_size
        slots = _first_members(run)
        num_outputs = members.num_outputs[slots]
        num_own = members.num_own_prompt_tokens[slots] + num_outputs
        reserved = np.maximum(num_outputs, members.reserved_decode_tokens[slots])
        need = -(-(members.num_own_prompt_tokens[slots] + reserved) // size)
        pending = num_own - members.num_computed_tokens[slots]
        budget_before = step.budget - (np.cumsum(pending) - pending)  # the budget each one finds
        admitted = (self._committed_blocks() + np.cumsum(need) <= self.threshold_blocks) & (budget_before > 0)
        num = int(np.argmin(admitted)) if not admitted.all() else len(run)
        if not num:
            return 0
        slots, need, pending, num_outputs = slots[:num], need[:num], pending[:num], num_outputs[:num]
        num_tokens = np.minimum(pending, budget_before[:num])
        num_blocks = -(-num_tokens // size)
        new_block_ids = self.pool.allocate_array(int(num_blocks.sum()))
        members.append_blocks(slots, num_blocks, new_block_ids)
        rank = self._next_rank
        self._next_rank += num
        admitted_groups, pending_groups = run[:num], self.pending_groups
        for group_rank, group in zip(range(rank, rank + num), admitted_groups):
            pending_groups.popleft()
            group.rank = group_rank
        members.key[slots] = ((rank + np.arange(num)) << RANK_SHIFT) + members.index[slots]
        members.running[slots] = True
        members.scheduled_stamp[slots] = step.stamp
        self._num_running += num
        self._started_running.extend(slots.tolist())
        self._promised_member_blocks += int((need - num_blocks).sum())  # need >= the blocks of its own tokens
        # A chunk that stops short of the prompt leaves prompt work (unless it leaves just the
        # newest output, a recompute's decode row).
        partial = num_tokens < pending
        for i in np.flatnonzero(partial & ~((num_outputs > 0) & (pending - num_tokens == 1))).tolist():
            self._add_work(run[i], int(slots[i]))
        step.add_lone_run(LoneRun(slots, num_tokens, ~partial, new_block_ids))
        return num

    # -- building a step ----------------------------------------------------------------

    def _schedule_decodes(self, step: "Step") -> None:
        """Queue 1: one row for each decoding member, in running order, while the budget lasts;
        their blocks in bulk while they fit under M_threshold, then one at a time, preempting."""
        running = self._running_slots()
        if step.budget <= 0 or not running.size:
            return
        members, size = self.members, self.block_size
        num_computed = members.num_computed_tokens[running]
        num_outputs = members.num_outputs[running]
        # decoding: an output, and exactly that one own token pending (Members.is_decoding)
        decoding = (num_outputs > 0) & (members.num_own_prompt_tokens[running] + num_outputs - num_computed == 1)
        if decoding.all():
            decoders = running
        else:
            decoders, num_computed, num_outputs = running[decoding], num_computed[decoding], num_outputs[decoding]
        chosen, num_computed, num_outputs = decoders[:step.budget], num_computed[:step.budget], num_outputs[:step.budget]
        # A member's blocks hold exactly its computed tokens (Members), so one more token takes a
        # block where they fill their last one.
        growing = _fills_blocks(num_computed, size)
        used = self.pool.num_used_blocks
        if used + int(np.count_nonzero(growing)) <= self.threshold_blocks:
            num_fast = chosen.shape[0]
        else:
            fits = used + np.cumsum(growing) <= self.threshold_blocks
            num_fast = int(np.argmin(fits))
        fast, growing = chosen[:num_fast], growing[:num_fast]
        if num_fast:
            new_block_ids = _NO_BLOCKS
            slots = fast[growing]
            if slots.size:
                # a block taken within the reservation was promised: one fewer promised
                promised_before = self._promised_array(slots)
                new_block_ids = self.pool.allocate_array(slots.shape[0])
                members.append_blocks(slots, np.ones(slots.shape[0], dtype=np.int64), new_block_ids)
                self._promised_member_blocks -= int(np.count_nonzero(promised_before))
            step.add_decodes(fast, num_computed[:num_fast], num_outputs[:num_fast], growing.astype(np.int64),
                             new_block_ids)
        # Past the first decode that does not fit: the exact order, one at a time. Only this path
        # preempts, so only it needs the stamps of the members scheduled so far in this step.
        slow = decoders[num_fast:]
        if slow.size and step.budget > 0:
            members.scheduled_stamp[fast] = step.stamp
        for slot in slow.tolist():
            if step.budget <= 0:
                break
            if not members.running[slot]:
                continue  # preempted by an earlier decode of this step
            before = int(members.num_blocks[slot])
            if self._grow_or_preempt(slot, step):
                members.scheduled_stamp[slot] = step.stamp
                grown = members.own_blocks(slot)[before:].copy()
                step.add_decodes(np.array([slot]), members.num_computed_tokens[[slot]], members.num_outputs[[slot]],
                                 np.array([grown.shape[0]]), grown)

    def _schedule_distinct(self, group: Group, step: "Step") -> None:
        members = self.members
        work = group.work
        slots = sorted(work, key=members.index.__getitem__) if len(work) > 1 else list(work)
        for slot in slots:
            if step.budget <= 0:
                return
            if members.waiting[slot]:
                if members.info[slot][0] in step.preempted:
                    continue  # never resume in the step that preempted it (no ping-pong)
                fits = self._committed_blocks() + self._need_blocks(slot) <= self.threshold_blocks
                if not fits and self._num_running:
                    continue
                self._start_running(slot)  # resume: recompute distinct + generated tokens
            num_outputs, num_computed = int(members.num_outputs[slot]), int(members.num_computed_tokens[slot])
            pending = members.info[slot][3] + num_outputs - num_computed
            if pending <= 0 or (num_outputs > 0 and pending == 1):
                continue  # nothing to compute, or decoding
            room = self._room_tokens(int(members.num_blocks[slot]), num_computed)
            num_tokens = min(pending, step.budget, room)
            if num_tokens <= 0:
                return  # memory full for prefill this step (BatchLLM 4.3.3)
            self._grow_member(slot, num_computed + num_tokens)
            step.add_member(group, slot, num_tokens)
            members.scheduled_stamp[slot] = step.stamp

    def _schedule_prefix(self, group: Group, step: "Step") -> None:
        remaining = len(group.prefix_token_ids) - group.prefix_num_computed
        if remaining > 0:
            room = self._room_tokens(len(group.prefix_block_ids), group.prefix_num_computed)
            num_tokens = min(remaining, step.budget, room)
            if num_tokens <= 0:
                return
            needed = self.pool.blocks_for_tokens(group.prefix_num_computed + num_tokens) - len(group.prefix_block_ids)
            if needed > 0:
                group.prefix_block_ids.extend(self.pool.allocate(needed))
                self._promised_prefix_blocks -= needed
            step.add_prefix(group, num_tokens)
            if num_tokens < remaining:
                return
        # Prefix stored by the end of this step's KV write: its distinct chunks may follow.
        if step.budget > 0:
            self._schedule_distinct(group, step)

    def _room_tokens(self, num_blocks: int, num_computed_tokens: int) -> int:
        """Tokens that fit in num_blocks blocks and the blocks left under M_threshold."""
        free_blocks = max(0, self.threshold_blocks - self.pool.num_used_blocks)
        return (num_blocks + free_blocks) * self.block_size - num_computed_tokens

    def _grow_member(self, slot: int, num_tokens: int) -> None:
        """Own blocks for num_tokens own tokens (a running member)."""
        needed = self.pool.blocks_for_tokens(num_tokens) - int(self.members.num_blocks[slot])
        if needed > 0:
            before = self._promised(slot)
            self.members.append_blocks(np.array([slot]), np.array([needed]), self.pool.allocate_array(needed))
            self._promised_member_blocks += self._promised(slot) - before

    def _grow_or_preempt(self, slot: int, step: "Step") -> bool:
        """Room for one more decode token of member `slot` under M_threshold, preempting if need be."""
        members = self.members
        while True:
            num_computed = int(members.num_computed_tokens[slot])
            needed = self.pool.blocks_for_tokens(num_computed + 1) - int(members.num_blocks[slot])
            if needed <= 0 or self.pool.num_used_blocks + needed <= self.threshold_blocks:
                self._grow_member(slot, num_computed + 1)
                return True
            victim = self._pick_victim_member(slot, step)
            if victim is not None:
                self._preempt_member(victim, step)
                continue
            victim_group = self._pick_victim_group(slot, step)
            if victim_group is not None:
                self._preempt_group(victim_group, step)
                continue
            self._preempt_member(slot, step)
            return False

    def _pick_victim_member(self, requester: int, step: "Step") -> int | None:
        """The last running member (by key) holding blocks and not scheduled in this step."""
        members = self.members
        candidates = self._running_order[::-1]
        usable = (members.running[candidates] & (members.num_blocks[candidates] > 0)
                  & (members.scheduled_stamp[candidates] != step.stamp) & (candidates != requester))
        index = int(np.argmax(usable))
        return int(candidates[index]) if usable.size and usable[index] else None

    def _pick_victim_group(self, requester: int, step: "Step") -> Group | None:
        members = self.members
        requester_group = int(members.group[requester])
        for group in reversed(list(self._with_prefix.values())):
            if group.group_id == requester_group or not group.prefix_block_ids:
                continue
            if not np.any(members.scheduled_stamp[np.array(group.members, dtype=np.int64)] == step.stamp):
                return group
        return None

    def _drop_blocks(self, slot: int) -> None:
        """The member's KV is gone (preempted or finished): its own blocks are freed, nothing is
        stored any more and the runner drops the row."""
        members = self.members
        self.pool.free(members.own_blocks(slot))
        members.num_blocks[slot] = 0
        members.num_computed_tokens[slot] = 0
        members.num_table_blocks_sent[slot] = 0
        members.last_sampled[slot] = False

    def _preempt_member(self, slot: int, step: "Step") -> None:
        members = self.members
        step.preempted.append(members.info[slot][0])
        if members.running[slot]:
            self._stop_running(slot)
        self._drop_blocks(slot)
        self._set_waiting(slot, self.groups[int(members.group[slot])])

    def _preempt_group(self, group: Group, step: "Step") -> None:
        """Whole group back to the head of the queue; its prefix is recomputed later."""
        members = self.members
        for slot in group.members:
            if members.finished[slot]:
                continue
            if members.num_blocks[slot] or members.running[slot]:
                step.preempted.append(members.info[slot][0])
            if members.running[slot]:
                self._stop_running(slot)
            self._drop_blocks(slot)
            if members.waiting[slot]:
                members.waiting[slot] = False
                self._num_waiting -= 1
        self._free_prefix(group)
        group.prefix_num_computed = 0
        group.members = [slot for slot in group.members if not members.finished[slot]] or group.members
        group.num_unfinished = sum(1 for slot in group.members if not members.finished[slot])
        self.pending_groups.appendleft(group)

    def update(self, output: SchedulerOutput, finish_reasons: dict[int, str]) -> list[FinishedRequest]:
        """Scheduler.update (interface.py): the named requests finish, in chunk order."""
        finished: list[FinishedRequest] = []
        if finish_reasons:
            chunks, slot_of, members = output.chunks, self._slot_of, self.members
            named = ~chunks.is_prefix & np.isin(chunks.seq_ids, np.fromiter(finish_reasons, dtype=np.int64))
            seq_ids = chunks.seq_ids[named].tolist()
            slots = np.array([slot_of.pop(seq_id) for seq_id in seq_ids], dtype=np.int64)
            # Their own blocks are freed in one go, as one member at a time in chunk order.
            own_block_ids, own_block_offsets = members.release_order(slots)
            self._finish_members(slots)
            lone = members.lone[slots]
            self._finish_lone(slots[lone])
            if lone.all():
                self.finished_seq_ids.extend(seq_ids)
                self.pool.release(own_block_ids)
                num_cached = [0] * len(seq_ids)  # no prompt token reused
            else:
                num_cached = self._finish_sharing(seq_ids, slots.tolist(), lone.tolist(), own_block_ids,
                                                  own_block_offsets)
            finished = list(map(FinishedRequest, seq_ids, map(finish_reasons.__getitem__, seq_ids), num_cached))
        self.step_index += 1
        return finished

    def _finish_sharing(self, seq_ids: list[int], slots: list[int], lone: list[bool], own_block_ids: np.ndarray,
                        own_block_offsets: np.ndarray) -> list[int]:
        """The finish of members that are not lone (in chunk order, among lone ones already
        finished): their groups' prefixes are freed with their last members, each after the own
        blocks listed before it; returns each member's prompt tokens reused."""
        num_cached, num_freed = [], 0  # of own_block_ids
        groups, info, finished_seq_ids = self.groups, self.members.info, self.finished_seq_ids
        for index, (seq_id, slot, is_lone) in enumerate(zip(seq_ids, slots, lone)):
            finished_seq_ids.append(seq_id)  # before its group's prefix id, if this frees it
            if is_lone:
                num_cached.append(0)
                continue
            group = groups[info[slot][1]]
            num_cached.append(self._finish(slot, group))
            if not group.num_unfinished:
                # BatchLLM 4.3.1: the prefix's memory is released as soon as its group is done.
                if group.prefix_block_ids:
                    end = int(own_block_offsets[index + 1])
                    self.pool.release(own_block_ids[num_freed:end])
                    num_freed = end
                self._free_prefix(group)
        self.pool.release(own_block_ids[num_freed:])
        return num_cached

    def _finish_members(self, slots: np.ndarray) -> None:
        """The array part of finishing members: they stop running or waiting, store nothing."""
        members = self.members
        running = slots[members.running[slots]]
        if running.size:
            self._promised_member_blocks -= int(self._promised_array(running).sum())
            members.running[running] = False
            self._num_running -= running.shape[0]
            self._stopped_running.extend(running.tolist())
        waiting = members.waiting[slots]
        if waiting.any():
            members.waiting[slots[waiting]] = False
            self._num_waiting -= int(waiting.sum())
        members.finished[slots] = True
        for name in ("num_blocks", "num_computed_tokens", "num_table_blocks_sent"):
            getattr(members, name)[slots] = 0
        members.last_sampled[slots] = False

    def _finish_lone(self, slots: np.ndarray) -> None:
        """The rest of finishing members that are groups of their own sharing nothing (after
        _finish_members): no prefix to free; their groups leave the lists of groups with work."""
        members, groups = self.members, self.groups
        prompt_arrays = members.prompt_arrays
        for slot in slots.tolist():
            prompt_arrays[slot] = None
        for group_id in members.group[slots].tolist():
            group = groups[group_id]
            group.num_unfinished = 0
            self._drop_work(group)

    def _finish(self, slot: int, group: Group) -> int:
        """The rest of finishing a member of `group` (after _finish_members; the caller frees its
        blocks, and its group's prefix once no member is left); returns its prompt tokens reused."""
        self.members.prompt_arrays[slot] = None
        if slot in group.work:
            self._discard_work(group, slot)
        group.num_unfinished -= 1
        # Every member but the first reused the prefix KV instead of computing it.
        return len(group.prefix_token_ids) if slot != group.members[0] else 0

    def _free_prefix(self, group: Group) -> None:
        """The group leaves the lists of admitted groups and its prefix blocks are freed (the runner
        drops the row)."""
        if not group.prefix_token_ids:  # shares nothing: no prefix blocks, no row
            self._drop_work(group)
            return
        self._promised_prefix_blocks -= (self.pool.blocks_for_tokens(len(group.prefix_token_ids))
                                         - len(group.prefix_block_ids))
        self.pool.free(group.prefix_block_ids)
        group.prefix_block_ids = []
        if group.num_prefix_blocks_sent:
            self.finished_seq_ids.append(group.prefix_id)
            group.num_prefix_blocks_sent = 0
        for groups in (self._prefix_pending, self._with_prefix, self._with_work):
            groups.pop(group.rank, None)
        group.work = set()
