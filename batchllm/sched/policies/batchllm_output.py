"""How the batchllm policy turns a scheduled step into its chunk columns: the decode rows and the
lone requests' prompt chunks as arrays, every other chunk through a ChunksBuilder, laid out group
by group (BatchLLM section 5); and what a step has taken while it is scheduled. A part of
BatchLLMScheduler (policies/batchllm.py), kept apart by what it does. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from batchllm.sched.chunks import count_offsets
from batchllm.sched.interface import ChunksBuilder, SchedulerOutput, ScheduledChunks
from batchllm.sched.policies.batchllm_state import RANK_SHIFT, Group

_NO_IDS = np.zeros(0, dtype=np.int64)


def _join_block_ids(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


class StepChunks:
    """BatchLLMScheduler's methods that build a step's SchedulerOutput (they read and advance its
    members' state)."""

    def _build_output(self, step: "Step") -> SchedulerOutput:
        # Rows group by group (BatchLLM 5): a group's prefix chunk, then its members' chunks. The
        # decode rows come first, in running order (group rank, place in group); a group's other
        # chunks follow its decode rows; the groups without decode rows come last, in the order
        # the step reached them.
        decodes, decode_slots = self._decode_chunks(step)
        chunks = decodes
        num_decode = num_prefix = num_distinct = 0
        if step.group_order:
            members = self.members
            last_rank = int(members.key[decode_slots[-1]]) >> RANK_SHIFT if decode_slots.size else -1
            ranks = None
            with_decodes: list[tuple[int, Group]] = []
            others: list[Group | LoneRun] = []
            for group in step.group_order:
                # an earlier group (not admitted in this step) may have decode rows
                if not isinstance(group, LoneRun) and group.rank <= last_rank:
                    if ranks is None:
                        ranks = members.key[decode_slots] >> RANK_SHIFT
                    end = int(np.searchsorted(ranks, group.rank, side="right"))
                    if end and ranks[end - 1] == group.rank:
                        with_decodes.append((end, group))
                        continue
                others.append(group)
            with_decodes.sort(key=lambda item: item[0])
            parts = []
            if with_decodes:
                builder = ChunksBuilder()
                positions: list[int] = []
                for end, group in with_decodes:
                    positions.extend([end] * self._group_chunks(builder, group, step))
                parts.append(builder.build())
                chunks = decodes.insert(np.array(positions, dtype=np.int64), parts[0])
            num_inserted = len(parts)
            builder = ChunksBuilder()
            for group in others:
                if isinstance(group, LoneRun):
                    if len(builder):
                        parts.append(builder.build())
                        builder = ChunksBuilder()
                    parts.append(self._lone_chunks(group))
                else:
                    self._group_chunks(builder, group, step)
            if len(builder):
                parts.append(builder.build())
            chunks = ScheduledChunks.concat([chunks, *parts[num_inserted:]])
            for part in parts:
                num_tokens = part.num_tokens
                part_decode = int(num_tokens[part.is_decode].sum())
                part_prefix = int(num_tokens[part.is_prefix & ~part.is_decode].sum())
                num_decode, num_prefix = num_decode + part_decode, num_prefix + part_prefix
                num_distinct += int(num_tokens.sum()) - part_decode - part_prefix
        finished, self.finished_seq_ids = self.finished_seq_ids, []
        return SchedulerOutput(self.step_index, chunks, num_decode + decode_slots.shape[0], num_distinct, num_prefix,
                               self._num_running, self.pool.num_used_blocks, tuple(step.preempted), tuple(finished))

    def _decode_chunks(self, step: "Step") -> tuple[ScheduledChunks, np.ndarray]:
        """The step's decode rows (one token each, sampled) as columns, counted as run; and their
        member slots."""
        if not step.decode_slots:
            return ScheduledChunks.empty(), np.zeros(0, dtype=np.int64)
        members = self.members
        if len(step.decode_slots) == 1:
            slots, num_computed = step.decode_slots[0], step.decode_num_computed[0]
            num_outputs, new_counts = step.decode_num_outputs[0], step.decode_new_counts[0]
        else:
            slots, num_computed, num_outputs, new_counts = (np.concatenate(parts) for parts in (
                step.decode_slots, step.decode_num_computed, step.decode_num_outputs, step.decode_new_counts))
        # A decode row's runner row is up to date but for the blocks it grew in this step (its
        # previous chunk sent every block it had then).
        sent = members.num_table_blocks_sent[slots]
        prompt_offset = members.prompt_offset[slots]
        starts = prompt_offset + num_computed
        fed = members.last_sampled[slots]
        token_ids = _NO_IDS
        if not fed.all():  # a recomputed token right before the newest output: its id is read
            token_ids = np.concatenate([members.token_ids(slot, start, start + 1)
                                        for slot, start in zip(slots[~fed].tolist(), starts[~fed].tolist())])
        num_rows = slots.shape[0]
        true = np.ones(num_rows, dtype=bool)
        chunks = ScheduledChunks(members.request_id[slots], starts, np.ones(num_rows, dtype=np.int64), sent,
                                 prompt_offset, members.chunk_group_id[slots], ~true, true, true,
                                 token_ids, np.zeros(num_rows + 1, dtype=np.int64) if fed.all() else count_offsets(~fed),
                                 _join_block_ids(step.decode_new_block_ids), count_offsets(new_counts))
        members.num_computed_tokens[slots] = num_computed + 1
        self._add_outputs(slots, num_outputs)
        members.last_sampled[slots] = True
        members.num_table_blocks_sent[slots] = sent + new_counts
        return chunks, slots

    def _add_outputs(self, slots: np.ndarray, num_outputs: np.ndarray | None = None) -> None:
        """One more output for each of slots (their chunks sample), and the blocks promised to
        those whose reservation grows with their outputs. num_outputs: their outputs before, if
        the caller has them."""
        members = self.members
        if num_outputs is None:
            num_outputs = members.num_outputs[slots]
        grows = num_outputs >= members.reserved_decode_tokens[slots]
        if grows.any():
            growing = slots[grows]
            promised_before = self._promised_array(growing)
            members.num_outputs[slots] = num_outputs + 1
            self._promised_member_blocks += int((self._promised_array(growing) - promised_before).sum())
        else:
            members.num_outputs[slots] = num_outputs + 1

    def _lone_chunks(self, run: "LoneRun") -> ScheduledChunks:
        """The prompt chunks of requests admitted by _admit_lone_requests (as _member_chunk makes
        them: every own block is new to the runner, the ids are the prompt's, then outputs read)."""
        members = self.members
        slots, num_tokens = run.slots, run.num_tokens
        prompt_arrays = members.prompt_arrays
        if (num_tokens <= members.prompt_offset[slots] + members.num_own_prompt_tokens[slots]).all():
            pieces = [prompt_arrays[slot][:count] for slot, count in zip(slots.tolist(), num_tokens.tolist())]
        else:  # a recompute: the outputs read so far follow the prompt
            pieces = [members.token_ids(slot, 0, count) for slot, count in zip(slots.tolist(), num_tokens.tolist())]
        num = slots.shape[0]
        zeros, false = np.zeros(num, dtype=np.int64), np.zeros(num, dtype=bool)
        chunks = ScheduledChunks(members.request_id[slots], zeros, num_tokens, zeros, zeros,
                                 members.chunk_group_id[slots], false, run.sample, false,
                                 np.concatenate(pieces), count_offsets(num_tokens),
                                 run.block_ids, count_offsets(members.num_blocks[slots]))
        members.num_computed_tokens[slots] = num_tokens
        self._add_outputs(slots[run.sample])
        members.last_sampled[slots] = run.sample
        members.num_table_blocks_sent[slots] = members.num_blocks[slots]
        members.num_row_prefix_blocks[slots] = 0
        return chunks

    def _group_chunks(self, builder: ChunksBuilder, group: Group, step: "Step") -> int:
        """Add a group's prefix chunk, then its members' chunks (not decode rows); returns how many."""
        num_chunks = 0
        prefix_tokens = step.prefix_tokens.get(group.group_id, 0)
        if prefix_tokens:
            start = group.prefix_num_computed
            blocks_sent = group.num_prefix_blocks_sent
            group.num_prefix_blocks_sent = len(group.prefix_block_ids)
            builder.add(group.prefix_id, group.prefix_token_ids[start:start + prefix_tokens], start, prefix_tokens,
                        group.prefix_block_ids[blocks_sent:], blocks_sent, 0, True, False, group.group_id)
            group.prefix_num_computed += prefix_tokens  # counted as stored from this step on
            if group.prefix_done:
                self._prefix_pending.pop(group.rank, None)
            num_chunks += 1
        for slot, num_tokens in step.member_tokens.get(group.group_id, ()):
            self._member_chunk(builder, group, slot, num_tokens)
            num_chunks += 1
        return num_chunks

    def _member_chunk(self, builder: ChunksBuilder, group: Group, slot: int, num_tokens: int) -> None:
        """The member's next num_tokens own tokens as a chunk, with the change that brings the
        runner's row (prefix blocks, then own blocks) up to date (docs/design.md); counted as run."""
        members = self.members
        request_id, _, prompt_offset, num_own_prompt, reserved, chunk_group_id = members.info[slot]
        num_computed = int(members.num_computed_tokens[slot])
        first = prompt_offset + num_computed
        blocks_sent = int(members.num_table_blocks_sent[slot])
        prefix_block_ids, own_block_ids = group.prefix_block_ids, members.own_blocks(slot).tolist()
        num_prefix_blocks = len(prefix_block_ids)
        if blocks_sent >= num_prefix_blocks:
            new_block_ids = own_block_ids[blocks_sent - num_prefix_blocks:]
        else:
            new_block_ids = prefix_block_ids[blocks_sent:] + own_block_ids
        members.num_table_blocks_sent[slot] = num_prefix_blocks + len(own_block_ids)
        members.num_row_prefix_blocks[slot] = num_prefix_blocks
        num_outputs = int(members.num_outputs[slot])
        num_own = num_own_prompt + num_outputs
        sample = num_computed + num_tokens == num_own
        is_decode = num_outputs > 0 and num_own - num_computed == 1
        token_ids = () if members.last_sampled[slot] else members.token_ids(slot, first, first + num_tokens)
        builder.add(request_id, token_ids, first, num_tokens, new_block_ids, blocks_sent, prompt_offset, False, sample,
                    chunk_group_id, is_decode)
        num_computed += num_tokens
        members.num_computed_tokens[slot] = num_computed
        if sample:
            if num_outputs >= reserved:  # its reservation grows with its outputs
                before = self._promised(slot)
                members.num_outputs[slot] = num_outputs + 1
                self._promised_member_blocks += self._promised(slot) - before
            else:
                members.num_outputs[slot] = num_outputs + 1
            num_outputs += 1
        members.last_sampled[slot] = sample
        if num_outputs > 0 and num_own_prompt + num_outputs - num_computed == 1:
            self._discard_work(group, slot)  # its prompt is done: a decode row from the next step


@dataclass(frozen=True, eq=False)
class LoneRun:
    """Requests admitted together by _admit_lone_requests: their member slots, prompt tokens
    scheduled, whether the chunk samples (it ends the prompt), and their new blocks (flat)."""

    slots: np.ndarray
    num_tokens: np.ndarray
    sample: np.ndarray
    block_ids: np.ndarray


@dataclass
class Step:
    """What one step has taken so far."""

    budget: int  # tokens left (N_chunk)
    stamp: int  # marks the members scheduled in this step (Members.scheduled_stamp)
    # Decode rows, in running order: member slots, their computed tokens and outputs before the
    # step, blocks each grew, the grown block ids (flat).
    decode_slots: list[np.ndarray] = field(default_factory=list)
    decode_num_computed: list[np.ndarray] = field(default_factory=list)
    decode_num_outputs: list[np.ndarray] = field(default_factory=list)
    decode_new_counts: list[np.ndarray] = field(default_factory=list)
    decode_new_block_ids: list[np.ndarray] = field(default_factory=list)
    # Every other chunk: the groups in the order the step reached them, their prefix and members' tokens.
    group_order: list[Group | LoneRun] = field(default_factory=list)
    member_tokens: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    prefix_tokens: dict[int, int] = field(default_factory=dict)
    preempted: list[int] = field(default_factory=list)

    def add_decodes(self, slots: np.ndarray, num_computed: np.ndarray, num_outputs: np.ndarray, new_counts: np.ndarray,
                    new_block_ids: np.ndarray) -> None:
        self.decode_slots.append(slots)
        self.decode_num_computed.append(num_computed)
        self.decode_num_outputs.append(num_outputs)
        self.decode_new_counts.append(new_counts)
        self.decode_new_block_ids.append(new_block_ids)
        self.budget -= slots.shape[0]

    def add_lone_run(self, run: LoneRun) -> None:
        self.group_order.append(run)
        self.budget -= int(run.num_tokens.sum())

    def _touch(self, group: Group) -> None:
        if group.group_id not in self.member_tokens:
            self.member_tokens[group.group_id] = []
            self.group_order.append(group)

    def add_member(self, group: Group, slot: int, num_tokens: int) -> None:
        self._touch(group)
        self.member_tokens[group.group_id].append((slot, num_tokens))
        self.budget -= num_tokens

    def add_prefix(self, group: Group, num_tokens: int) -> None:
        self._touch(group)
        self.prefix_tokens[group.group_id] = num_tokens
        self.budget -= num_tokens
