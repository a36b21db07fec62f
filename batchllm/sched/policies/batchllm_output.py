"""How the batchllm policy turns a scheduled step into its chunk columns: the decode rows and the
lone requests' prompt chunks as arrays, every other chunk one at a time, all written into one
ChunkColumns, laid out group by group (BatchLLM section 5); and what a step has taken while it is
scheduled. A part of BatchLLMScheduler (policies/batchllm.py), kept apart by what it does.
Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import itemgetter

import numpy as np

from batchllm.sched.chunks import ChunkColumns, join_ids
from batchllm.sched.interface import SchedulerOutput
from batchllm.sched.policies.batchllm_state import RANK_SHIFT, Group

_NO_IDS = np.zeros(0, dtype=np.int64)


def _gather(values: np.ndarray, slots: np.ndarray, out: np.ndarray) -> np.ndarray:
    """values[slots] written into out; returns out. mode="clip" (slots are in range): the default
    mode buffers the output, one more copy."""
    return np.take(values, slots, out=out, mode="clip")


def _prompt_heads(prompt_arrays: list, slots: np.ndarray, num_tokens: np.ndarray,
                  num_prompt_tokens: np.ndarray) -> np.ndarray:
    """The first num_tokens ids of each slot's prompt, joined as int64. Whole prompts are taken as
    they are, only the cut ones sliced: half the time of slicing each (80 prompts), and of a
    gather from one flat array of every prompt."""
    pieces = list(itemgetter(*slots.tolist())(prompt_arrays)) if slots.shape[0] > 1 else [prompt_arrays[slots[0]]]
    for i in np.flatnonzero(num_tokens < num_prompt_tokens).tolist():
        pieces[i] = pieces[i][:num_tokens[i]]
    return np.concatenate(pieces, dtype=np.int64)


class StepChunks:
    """BatchLLMScheduler's methods that build a step's SchedulerOutput (they read and advance its
    members' state)."""

    def _build_output(self, step: "Step") -> SchedulerOutput:
        # Rows group by group (BatchLLM 5): a group's prefix chunk, then its members' chunks. The
        # decode rows come first, in running order (group rank, place in group); a group's other
        # chunks follow its decode rows; the groups without decode rows come last, in the order
        # the step reached them.
        slots = join_ids(step.decode_slots)
        num_decode = slots.shape[0]
        columns = ChunkColumns(num_decode + step.num_other_chunks)
        if num_decode:
            self._decode_chunks(columns, step, slots)
        with_decodes, others = self._split_by_decodes(step.group_order, slots)
        for group in others:
            if isinstance(group, LoneRun):
                self._lone_chunks(columns, group)
            else:
                self._group_chunks(columns, group, step)
        # Rows are written in turn: the chunks of groups with decode rows last, then moved after those.
        positions: list[int] = []
        for end, group in with_decodes:
            positions.extend([end] * self._group_chunks(columns, group, step))
        num_tokens, is_decode = columns.num_tokens[num_decode:], columns.is_decode[num_decode:]
        num_other_decode = int(num_tokens[is_decode].sum())
        num_prefix = int(num_tokens[columns.is_prefix[num_decode:] & ~is_decode].sum())
        num_distinct = int(num_tokens.sum()) - num_other_decode - num_prefix
        chunks = columns.build()
        if positions:
            chunks = chunks.move_tail(np.array(positions, dtype=np.int64))
        finished, self.finished_seq_ids = self.finished_seq_ids, []
        return SchedulerOutput(self.step_index, chunks, num_decode + num_other_decode, num_distinct, num_prefix,
                               self._num_running, self.pool.num_used_blocks, tuple(step.preempted), tuple(finished))

    def _split_by_decodes(self, group_order: list[Group | LoneRun], decode_slots: np.ndarray
                          ) -> tuple[list[tuple[int, Group]], list[Group | LoneRun]]:
        """The groups of group_order with decode rows in this step, each with the end of its decode
        rows, by that end; and the others, in their order."""
        with_decodes: list[tuple[int, Group]] = []
        others: list[Group | LoneRun] = []
        if not group_order:
            return with_decodes, others
        members = self.members
        last_rank = int(members.key[decode_slots[-1]]) >> RANK_SHIFT if decode_slots.size else -1
        ranks = None
        for group in group_order:
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
        return with_decodes, others

    def _decode_chunks(self, columns: ChunkColumns, step: "Step", slots: np.ndarray) -> None:
        """The step's decode rows (one token each, sampled) into the next rows of columns, counted
        as run; slots: their member slots."""
        members = self.members
        num_computed, num_outputs, new_counts = (join_ids(parts) for parts in (
            step.decode_num_computed, step.decode_num_outputs, step.decode_new_counts))
        num_rows = slots.shape[0]
        fed = members.last_sampled[slots]
        all_fed = bool(fed.all())
        token_ids = _NO_IDS
        if not all_fed:  # a recomputed token right before the newest output: its id is read
            starts = members.prompt_offset[slots] + num_computed
            token_ids = np.concatenate([members.token_ids(slot, start, start + 1)
                                        for slot, start in zip(slots[~fed].tolist(), starts[~fed].tolist())])
        rows = columns.next_rows(num_rows, token_ids, join_ids(step.decode_new_block_ids))
        # A decode row's runner row is up to date but for the blocks it grew in this step (its
        # previous chunk sent every block it had then).
        sent = _gather(members.num_table_blocks_sent, slots, columns.block_ids_start[rows])
        prompt_offset = _gather(members.prompt_offset, slots, columns.shared_kv_lens[rows])
        np.add(prompt_offset, num_computed, out=columns.start_positions[rows])
        _gather(members.request_id, slots, columns.seq_ids[rows])
        _gather(members.chunk_group_id, slots, columns.group_ids[rows])
        columns.num_tokens[rows] = 1
        columns.is_prefix[rows], columns.sample[rows], columns.is_decode[rows] = False, True, True
        columns.num_token_ids[rows] = 0 if all_fed else ~fed
        columns.num_new_block_ids[rows] = new_counts
        members.num_computed_tokens[slots] = num_computed + 1
        self._add_outputs(slots, num_outputs)
        members.last_sampled[slots] = True
        members.num_table_blocks_sent[slots] = sent + new_counts

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

    def _lone_chunks(self, columns: ChunkColumns, run: "LoneRun") -> None:
        """The prompt chunks of requests admitted by _admit_lone_requests into the next rows of
        columns (as _member_chunk makes them: every own block is new to the runner, the ids are the
        prompt's, then outputs read)."""
        members = self.members
        slots, num_tokens = run.slots, run.num_tokens
        num_prompt_tokens = members.prompt_offset[slots] + members.num_own_prompt_tokens[slots]
        if (num_tokens <= num_prompt_tokens).all():
            token_ids = _prompt_heads(members.prompt_arrays, slots, num_tokens, num_prompt_tokens)
        else:  # a recompute: the outputs read so far follow the prompt
            token_ids = np.concatenate([members.token_ids(slot, 0, count)
                                        for slot, count in zip(slots.tolist(), num_tokens.tolist())])
        rows = columns.next_rows(slots.shape[0], token_ids, run.block_ids)
        _gather(members.request_id, slots, columns.seq_ids[rows])
        _gather(members.chunk_group_id, slots, columns.group_ids[rows])
        num_blocks = _gather(members.num_blocks, slots, columns.num_new_block_ids[rows])
        columns.num_tokens[rows] = columns.num_token_ids[rows] = num_tokens
        columns.start_positions[rows] = columns.block_ids_start[rows] = columns.shared_kv_lens[rows] = 0
        columns.is_prefix[rows], columns.sample[rows], columns.is_decode[rows] = False, run.sample, False
        members.num_computed_tokens[slots] = num_tokens
        self._add_outputs(slots[run.sample])
        members.last_sampled[slots] = run.sample
        members.num_table_blocks_sent[slots] = num_blocks
        members.num_row_prefix_blocks[slots] = 0

    def _group_chunks(self, columns: ChunkColumns, group: Group, step: "Step") -> int:
        """Add a group's prefix chunk, then its members' chunks (not decode rows); returns how many."""
        num_chunks = 0
        prefix_tokens = step.prefix_tokens.get(group.group_id, 0)
        if prefix_tokens:
            start = group.prefix_num_computed
            blocks_sent = group.num_prefix_blocks_sent
            group.num_prefix_blocks_sent = len(group.prefix_block_ids)
            columns.add(group.prefix_id, group.prefix_token_ids[start:start + prefix_tokens], start, prefix_tokens,
                        group.prefix_block_ids[blocks_sent:], blocks_sent, 0, True, False, group.group_id)
            group.prefix_num_computed += prefix_tokens  # counted as stored from this step on
            if group.prefix_done:
                self._prefix_pending.pop(group.rank, None)
            num_chunks += 1
        for slot, num_tokens in step.member_tokens.get(group.group_id, ()):
            self._member_chunk(columns, group, slot, num_tokens)
            num_chunks += 1
        return num_chunks

    def _member_chunk(self, columns: ChunkColumns, group: Group, slot: int, num_tokens: int) -> None:
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
        columns.add(request_id, token_ids, first, num_tokens, new_block_ids, blocks_sent, prompt_offset, False, sample,
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
    num_other_chunks: int = 0  # chunks that are not in the decode rows

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
        self.num_other_chunks += run.slots.shape[0]
        self.budget -= int(run.num_tokens.sum())

    def _touch(self, group: Group) -> None:
        if group.group_id not in self.member_tokens:
            self.member_tokens[group.group_id] = []
            self.group_order.append(group)

    def add_member(self, group: Group, slot: int, num_tokens: int) -> None:
        self._touch(group)
        self.member_tokens[group.group_id].append((slot, num_tokens))
        self.num_other_chunks += 1
        self.budget -= num_tokens

    def add_prefix(self, group: Group, num_tokens: int) -> None:
        self._touch(group)
        self.prefix_tokens[group.group_id] = num_tokens
        self.num_other_chunks += 1
        self.budget -= num_tokens
