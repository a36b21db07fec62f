"""Replays a SchedulerOutput stream into a fake paged KV store and checks the contract of
interface.py, as docs/design.md ("Simulating schedules") lists (used by the tests and
`simulate --check`; torch-free)."""

from __future__ import annotations

from batchllm.sched.block_table import BlockTableTracker
from batchllm.sched.interface import NO_GROUP, SchedRequest, SchedulerOutput, ScheduledChunk


class ContractError(AssertionError):
    pass


class ChunkStreamChecker:
    def __init__(self, requests: list[SchedRequest], block_size: int) -> None:
        self.block_size = block_size
        self.prompts = {r.request_id: list(r.prompt_token_ids) for r in requests}
        self.outputs: dict[int, list[int]] = {r.request_id: [] for r in requests}
        self.blocks: dict[int, list[int | None]] = {}  # block id -> slot contents
        self.stored: dict[int, int | None] = {r.request_id: None for r in requests}  # None: fresh
        self.prefix_contents: dict[int, list[int]] = {}  # prefix id -> tokens stored so far
        self.group_prefix_id: dict[int, int] = {}
        self.finished: set[int] = set()
        self.tables = BlockTableTracker()
        self.fixed_fields: dict[int, tuple[int, int, bool]] = {}  # seq id -> fields fixed while it has a row
        # The runner's last-token column: the token a seq's latest chunk sampled, while it keeps its row.
        self.last_sampled: dict[int, int] = {}

    def check_step(self, output: SchedulerOutput) -> dict[int, tuple[int, ...]]:
        """Validate one step; returns, for each sampling chunk, the token sequence it sees."""
        for request_id in output.preempted_request_ids:
            self.stored[request_id] = None
        for seq_id in output.dropped_seq_ids:
            self.fixed_fields.pop(seq_id, None)
            self.last_sampled.pop(seq_id, None)
        for chunk in output.chunks:
            fields = (chunk.shared_kv_len, chunk.group_id, chunk.is_prefix)
            if self.fixed_fields.setdefault(chunk.seq_id, fields) != fields:
                raise ContractError(f"seq {chunk.seq_id}: (shared_kv_len, group_id, is_prefix) changed from "
                                    f"{self.fixed_fields[chunk.seq_id]} to {fields} while it has a row")
        self._check_layout(output.chunks)
        try:
            tables = self.tables.apply(output)
        except ValueError as error:
            raise ContractError(f"step {output.step_index}: {error}") from error
        for chunk, table in zip(output.chunks, tables):
            self._write(chunk, self._input_ids(chunk), table)
        seen: dict[int, tuple[int, ...]] = {}
        for chunk, table in zip(output.chunks, tables):
            visible = self._read(chunk, table)
            if chunk.is_prefix:
                expected = self.prefix_contents[chunk.seq_id][: chunk.kv_len]
                if chunk.sample:
                    raise ContractError(f"prefix chunk {chunk.seq_id} asks to sample")
            else:
                logical = self.prompts[chunk.seq_id] + self.outputs[chunk.seq_id]
                expected = logical[: chunk.kv_len]
                if chunk.sample != (chunk.kv_len == len(logical)):
                    raise ContractError(f"request {chunk.seq_id}: sample={chunk.sample} at kv_len {chunk.kv_len} of {len(logical)}")
            if list(visible) != list(expected):
                raise ContractError(f"seq {chunk.seq_id} step {output.step_index}: KV read-back differs from its tokens")
            if chunk.sample:
                seen[chunk.seq_id] = tuple(visible)
        return seen

    def record(self, sampled_token_ids: dict[int, int], finished_ids: list[int]) -> None:
        for request_id, token in sampled_token_ids.items():
            self.outputs[request_id].append(token)
            self.last_sampled[request_id] = token
        for request_id in finished_ids:
            if request_id in self.finished:
                raise ContractError(f"request {request_id} finished twice")
            self.finished.add(request_id)

    def _check_layout(self, chunks: tuple[ScheduledChunk, ...]) -> None:
        closed: set[int] = set()
        current = None
        members_seen: set[int] = set()
        for chunk in chunks:
            group = chunk.group_id
            if group != current:
                if current is not None and current != NO_GROUP:
                    closed.add(current)
                if group in closed:
                    raise ContractError(f"chunks of group {group} are not adjacent")
                current = group
            if chunk.is_prefix:
                if group == NO_GROUP:
                    raise ContractError("prefix chunk without a group")
                if group in members_seen:
                    raise ContractError(f"group {group}: prefix chunk after a member chunk")
                known = self.group_prefix_id.setdefault(group, chunk.seq_id)
                if known != chunk.seq_id or chunk.seq_id in self.prompts:
                    raise ContractError(f"group {group}: bad prefix id {chunk.seq_id}")
            else:
                members_seen.add(group)
                if chunk.seq_id not in self.prompts or chunk.seq_id in self.finished:
                    raise ContractError(f"chunk for unknown or finished request {chunk.seq_id}")

    def _input_ids(self, chunk: ScheduledChunk) -> tuple[int, ...]:
        """The chunk's input ids as the runner sees them; a decode row's from the last-token column."""
        last_sampled = self.last_sampled.pop(chunk.seq_id, None)
        if chunk.token_ids:
            if len(chunk.token_ids) != chunk.num_tokens:
                raise ContractError(f"seq {chunk.seq_id}: {len(chunk.token_ids)} ids for {chunk.num_tokens} rows")
            return chunk.token_ids
        if chunk.num_tokens != 1 or chunk.is_prefix or last_sampled is None:
            raise ContractError(f"seq {chunk.seq_id}: a chunk without ids must be one row right after a chunk "
                                "of the same row that sampled")
        return (last_sampled,)

    def _write(self, chunk: ScheduledChunk, token_ids: tuple[int, ...], table: tuple[int, ...]) -> None:
        if chunk.is_prefix:
            content = self.prefix_contents.setdefault(chunk.seq_id, [])
            if chunk.shared_kv_len != 0:
                raise ContractError("prefix chunk with shared_kv_len")
            if chunk.start_position == 0:
                del content[:]  # a prefix recomputed after its group was preempted
            if chunk.start_position != len(content):
                raise ContractError(f"prefix {chunk.seq_id}: start {chunk.start_position}, stored {len(content)}")
            content.extend(token_ids)
        else:
            stored = self.stored[chunk.seq_id]
            if chunk.shared_kv_len:
                prefix_id = self.group_prefix_id.get(chunk.group_id)
                if prefix_id is None or len(self.prefix_contents.get(prefix_id, ())) < chunk.shared_kv_len:
                    raise ContractError(f"request {chunk.seq_id} runs before its group's prefix is stored")
            if stored is None:
                if chunk.shared_kv_len and chunk.start_position != chunk.shared_kv_len:
                    raise ContractError(f"request {chunk.seq_id}: own tokens must start at the prefix length")
            elif chunk.start_position != stored:
                raise ContractError(f"request {chunk.seq_id}: start {chunk.start_position}, stored {stored}")
            if chunk.start_position < chunk.shared_kv_len:
                raise ContractError(f"request {chunk.seq_id} writes into shared prefix blocks")
            self.stored[chunk.seq_id] = chunk.kv_len
        for offset, token in enumerate(token_ids):
            block_id, slot = self._address(chunk, table, chunk.start_position + offset)
            self.blocks.setdefault(block_id, [None] * self.block_size)[slot] = token

    def _read(self, chunk: ScheduledChunk, table: tuple[int, ...]) -> list[int | None]:
        addresses = (self._address(chunk, table, position) for position in range(chunk.kv_len))
        return [self.blocks.get(block_id, [None] * self.block_size)[slot] for block_id, slot in addresses]

    def _address(self, chunk: ScheduledChunk, table: tuple[int, ...], position: int) -> tuple[int, int]:
        size = self.block_size
        shared = chunk.shared_kv_len
        if position < shared:
            index, slot = position // size, position % size
        else:
            index = -(-shared // size) + (position - shared) // size
            slot = (position - shared) % size
        if index >= len(table):
            raise ContractError(f"seq {chunk.seq_id}: position {position} beyond its {len(table)} blocks")
        return table[index], slot
