"""A step's chunks as columns: one numpy entry per chunk, the ids and block-table changes flat with
offsets. Policies build them without a Python object per row; the runner reads them vectorised;
ScheduledChunk objects appear only where a caller iterates (tests, the contract checker).
Torch-free."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

NO_GROUP = -1

# Per-chunk columns: (name, dtype), in ScheduledChunk's field order.
_INT_COLUMNS = ("seq_ids", "start_positions", "num_tokens", "block_ids_start", "shared_kv_lens", "group_ids")
_BOOL_COLUMNS = ("is_prefix", "sample", "is_decode")


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


class ScheduledChunks(Sequence[ScheduledChunk]):
    """The chunks of one step, in row order, as columns ([num_chunks] each) plus two flat arrays:
    chunk i's input ids are token_ids[token_id_offsets[i]:token_id_offsets[i + 1]] (none for a
    decode row fed on the device) and its block-table change new_block_ids[new_block_offsets[i]:
    new_block_offsets[i + 1]]. Indexing or iterating gives ScheduledChunk objects (slow path)."""

    __slots__ = (*_INT_COLUMNS, *_BOOL_COLUMNS, "token_ids", "token_id_offsets", "new_block_ids",
                 "new_block_offsets", "_objects")

    def __init__(self, seq_ids, start_positions, num_tokens, block_ids_start, shared_kv_lens, group_ids, is_prefix,
                 sample, is_decode, token_ids, token_id_offsets, new_block_ids, new_block_offsets) -> None:
        self.seq_ids: np.ndarray = np.asarray(seq_ids, dtype=np.int64)
        self.start_positions: np.ndarray = np.asarray(start_positions, dtype=np.int64)
        self.num_tokens: np.ndarray = np.asarray(num_tokens, dtype=np.int64)
        self.block_ids_start: np.ndarray = np.asarray(block_ids_start, dtype=np.int64)
        self.shared_kv_lens: np.ndarray = np.asarray(shared_kv_lens, dtype=np.int64)
        self.group_ids: np.ndarray = np.asarray(group_ids, dtype=np.int64)
        self.is_prefix: np.ndarray = np.asarray(is_prefix, dtype=bool)
        self.sample: np.ndarray = np.asarray(sample, dtype=bool)
        self.is_decode: np.ndarray = np.asarray(is_decode, dtype=bool)
        self.token_ids: np.ndarray = np.asarray(token_ids, dtype=np.int64)
        self.token_id_offsets: np.ndarray = np.asarray(token_id_offsets, dtype=np.int64)
        self.new_block_ids: np.ndarray = np.asarray(new_block_ids, dtype=np.int64)
        self.new_block_offsets: np.ndarray = np.asarray(new_block_offsets, dtype=np.int64)
        self._objects: tuple[ScheduledChunk, ...] | None = None

    @classmethod
    def empty(cls) -> "ScheduledChunks":
        return ChunksBuilder().build()

    @classmethod
    def from_chunks(cls, chunks: Iterable[ScheduledChunk]) -> "ScheduledChunks":
        builder = ChunksBuilder()
        for c in chunks:
            builder.add(c.seq_id, c.token_ids, c.start_position, c.num_tokens, c.new_block_ids, c.block_ids_start,
                        c.shared_kv_len, c.is_prefix, c.sample, c.group_id, c.is_decode)
        return builder.build()

    @property
    def kv_lens(self) -> np.ndarray:
        """KV positions each chunk's last row sees after the step's KV is stored."""
        return self.start_positions + self.num_tokens

    @property
    def num_token_ids(self) -> np.ndarray:
        """Input ids each chunk carries: num_tokens, or 0 for a decode row fed on the device."""
        return np.diff(self.token_id_offsets)

    @property
    def num_new_block_ids(self) -> np.ndarray:
        return np.diff(self.new_block_offsets)

    def __len__(self) -> int:
        return int(self.seq_ids.shape[0])

    @overload
    def __getitem__(self, index: int) -> ScheduledChunk: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[ScheduledChunk, ...]: ...

    def __getitem__(self, index):
        return self.objects()[index]

    def __iter__(self) -> Iterator[ScheduledChunk]:
        return iter(self.objects())

    def objects(self) -> tuple[ScheduledChunk, ...]:
        """Every chunk as a ScheduledChunk (built once)."""
        if self._objects is None:
            token_ids, new_block_ids = self.token_ids.tolist(), self.new_block_ids.tolist()
            token_offsets, block_offsets = self.token_id_offsets.tolist(), self.new_block_offsets.tolist()
            self._objects = tuple(
                ScheduledChunk(seq_id, tuple(token_ids[token_offsets[i]:token_offsets[i + 1]]), start, num_tokens,
                               tuple(new_block_ids[block_offsets[i]:block_offsets[i + 1]]), block_start, shared,
                               is_prefix, sample, group_id, is_decode)
                for i, (seq_id, start, num_tokens, block_start, shared, group_id, is_prefix, sample, is_decode)
                in enumerate(zip(*(getattr(self, name).tolist() for name in (*_INT_COLUMNS, *_BOOL_COLUMNS))))
            )
        return self._objects

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ScheduledChunks):
            return all(np.array_equal(getattr(self, name), getattr(other, name)) for name in _ALL_ARRAYS)
        if isinstance(other, (tuple, list)):
            return self.objects() == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable arrays inside

    def __repr__(self) -> str:
        return f"ScheduledChunks({list(self.objects())!r})"

    def take(self, order: np.ndarray) -> "ScheduledChunks":
        """The chunks at `order` (indices into this step's chunks), in that order."""
        token_ids, token_offsets = _take_segments(self.token_ids, self.token_id_offsets, order)
        block_ids, block_offsets = _take_segments(self.new_block_ids, self.new_block_offsets, order)
        columns = [getattr(self, name)[order] for name in (*_INT_COLUMNS, *_BOOL_COLUMNS)]
        return ScheduledChunks(*columns, token_ids, token_offsets, block_ids, block_offsets)

    def move_tail(self, positions: np.ndarray) -> "ScheduledChunks":
        """These chunks with the last len(positions) ones (the tail) moved: tail chunk j before
        chunk positions[j] of the others (positions non-decreasing; their count places after the
        last); tail chunks at one position keep their order."""
        num_extra = positions.shape[0]
        if not num_extra:
            return self
        num_base = len(self) - num_extra
        # Final place of base chunk i: i + extras placed at or before it; of extra j: positions[j] + j.
        base_place = np.arange(num_base) + np.searchsorted(positions, np.arange(num_base), side="right")
        extra_place = np.asarray(positions, dtype=np.int64) + np.arange(num_extra)
        order = np.empty(num_base + num_extra, dtype=np.int64)
        order[base_place] = np.arange(num_base)
        order[extra_place] = num_base + np.arange(num_extra)
        return self.take(order)


_ALL_ARRAYS = (*_INT_COLUMNS, *_BOOL_COLUMNS, "token_ids", "token_id_offsets", "new_block_ids", "new_block_offsets")


def count_offsets(counts: np.ndarray) -> np.ndarray:
    """[0, counts[0], counts[0] + counts[1], ...]: where each of the segments starts, then the end."""
    offsets = np.zeros(counts.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return offsets


def _take_segments(values: np.ndarray, offsets: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The segments values[offsets[i]:offsets[i + 1]] for i in order, concatenated, and their offsets."""
    starts, counts = offsets[:-1][order], np.diff(offsets)[order]
    new_offsets = count_offsets(counts)
    total = int(new_offsets[-1])
    if total == 0:
        return values[:0], new_offsets
    # Source index of each output element: its segment's start + its place in the segment.
    index = np.arange(total) + np.repeat(starts - new_offsets[:-1], counts)
    return values[index], new_offsets


class ChunksBuilder:
    """Appends chunks one at a time (Python lists), then builds the columns in one go."""

    __slots__ = ("_columns", "_token_pieces", "_token_counts", "_block_ids", "_block_counts")

    def __init__(self) -> None:
        self._columns: tuple[list, ...] = tuple([] for _ in range(len(_INT_COLUMNS) + len(_BOOL_COLUMNS)))
        # Each chunk's ids as given (an integer array or a sequence of ints), joined in build().
        self._token_pieces: list = []
        self._token_counts: list[int] = []
        self._block_ids: list[int] = []
        self._block_counts: list[int] = []

    def __len__(self) -> int:
        return len(self._columns[0])

    def add(self, seq_id: int, token_ids: Sequence[int], start_position: int, num_tokens: int,
            new_block_ids: Sequence[int], block_ids_start: int = 0, shared_kv_len: int = 0, is_prefix: bool = False,
            sample: bool = False, group_id: int = NO_GROUP, is_decode: bool = False) -> None:
        """One chunk, ScheduledChunk's fields in its order."""
        seq_ids, starts, counts, block_starts, shared, groups, prefix, samples, decode = self._columns
        seq_ids.append(seq_id)
        starts.append(start_position)
        counts.append(num_tokens)
        block_starts.append(block_ids_start)
        shared.append(shared_kv_len)
        groups.append(group_id)
        prefix.append(is_prefix)
        samples.append(sample)
        decode.append(is_decode)
        num_token_ids = len(token_ids)
        if num_token_ids:
            self._token_pieces.append(token_ids)
        self._token_counts.append(num_token_ids)
        self._block_ids.extend(new_block_ids)
        self._block_counts.append(len(new_block_ids))

    def build(self) -> ScheduledChunks:
        int_columns = [np.array(c, dtype=np.int64) for c in self._columns[:len(_INT_COLUMNS)]]
        bool_columns = [np.array(c, dtype=bool) for c in self._columns[len(_INT_COLUMNS):]]
        return ScheduledChunks(*int_columns, *bool_columns,
                               join_ids(self._token_pieces),
                               count_offsets(np.array(self._token_counts, dtype=np.int64)),
                               np.array(self._block_ids, dtype=np.int64),
                               count_offsets(np.array(self._block_counts, dtype=np.int64)))


def join_ids(pieces: list) -> np.ndarray:
    """The pieces (integer arrays or sequences of ints) as one int64 array."""
    if not pieces:
        return np.zeros(0, dtype=np.int64)
    if len(pieces) == 1:
        return np.asarray(pieces[0], dtype=np.int64)
    return np.concatenate([np.asarray(piece) for piece in pieces]).astype(np.int64, copy=False)


class ChunkColumns:
    """A step's chunks written part by part into columns allocated once for all of them, then
    built: a part's arrays are written (gathered, filled) straight into its rows, with no
    concatenation of parts (that cost 50-130 us a step beside ~6,500 decode rows). The columns
    are ScheduledChunks', and each chunk's number of input ids and of new block ids."""

    __slots__ = (*_INT_COLUMNS, *_BOOL_COLUMNS, "num_token_ids", "num_new_block_ids", "num_written", "_token_pieces",
                 "_block_pieces")

    def __init__(self, num_chunks: int) -> None:
        for name in (*_INT_COLUMNS, "num_token_ids", "num_new_block_ids"):
            setattr(self, name, np.empty(num_chunks, dtype=np.int64))
        for name in _BOOL_COLUMNS:
            setattr(self, name, np.empty(num_chunks, dtype=bool))
        self.num_written = 0
        # The input ids and new block ids of the chunks written so far, in row order, in pieces.
        self._token_pieces: list = []
        self._block_pieces: list = []

    def next_rows(self, num_chunks: int, token_ids: np.ndarray, new_block_ids: np.ndarray) -> slice:
        """The rows of the next num_chunks chunks (the caller fills every column there), whose
        input ids and new block ids, in row order, are token_ids and new_block_ids."""
        start = self.num_written
        self.num_written = start + num_chunks
        if token_ids.shape[0]:
            self._token_pieces.append(token_ids)
        if new_block_ids.shape[0]:
            self._block_pieces.append(new_block_ids)
        return slice(start, start + num_chunks)

    def add(self, seq_id: int, token_ids: Sequence[int], start_position: int, num_tokens: int,
            new_block_ids: Sequence[int], block_ids_start: int = 0, shared_kv_len: int = 0, is_prefix: bool = False,
            sample: bool = False, group_id: int = NO_GROUP, is_decode: bool = False) -> None:
        """One chunk in the next row, as ChunksBuilder.add."""
        row = self.num_written
        self.num_written = row + 1
        self.seq_ids[row], self.start_positions[row], self.num_tokens[row] = seq_id, start_position, num_tokens
        self.block_ids_start[row], self.shared_kv_lens[row], self.group_ids[row] = (block_ids_start, shared_kv_len,
                                                                                    group_id)
        self.is_prefix[row], self.sample[row], self.is_decode[row] = is_prefix, sample, is_decode
        self.num_token_ids[row] = num_token_ids = len(token_ids)
        self.num_new_block_ids[row] = num_block_ids = len(new_block_ids)
        if num_token_ids:
            self._token_pieces.append(token_ids)
        if num_block_ids:
            self._block_pieces.append(new_block_ids)

    def build(self) -> ScheduledChunks:
        """The chunks (every row written)."""
        if self.num_written != self.seq_ids.shape[0]:
            raise AssertionError(f"{self.num_written} of {self.seq_ids.shape[0]} chunks written")
        return ScheduledChunks(*(getattr(self, name) for name in (*_INT_COLUMNS, *_BOOL_COLUMNS)),
                               join_ids(self._token_pieces), count_offsets(self.num_token_ids),
                               join_ids(self._block_pieces), count_offsets(self.num_new_block_ids))
