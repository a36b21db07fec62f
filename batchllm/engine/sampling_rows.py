"""The sampling settings of a step's sampled rows as columns (one numpy entry per row): what the step
loop hands the runner, built without a Python tuple per row. Torch-free."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

MASK32 = 0xFFFFFFFF
NO_LOGPROBS = -1  # logprobs column: the row asked for none


@dataclass(frozen=True, eq=False)
class PenaltyRows:
    """A step's penalised rows and min_tokens bans, for the device's count table
    (engine/penalties.py). Rows without a penalty or a ban are in none of the arrays."""

    rows: np.ndarray  # int64 [k]: rows with a presence, frequency or repetition penalty, ascending
    slots: np.ndarray  # int64 [k]: their requests' rows of the count table
    presence: np.ndarray  # float32 [k]
    frequency: np.ndarray  # float32 [k]
    repetition: np.ndarray  # float32 [k]
    num_slots: int  # slots handed out so far: the table holds at least this many rows
    new_slots: np.ndarray  # int64: slots first used this step (their counts and prompt marks start at zero)
    prompt_slots: np.ndarray  # int64: with prompt_token_ids, the (slot, id) pairs of the new slots' prompts
    prompt_token_ids: np.ndarray  # int64
    ban_rows: np.ndarray  # int64: with ban_token_ids, (row, id) pairs that cannot be sampled (min_tokens)
    ban_token_ids: np.ndarray  # int64

    @property
    def leading_rows(self) -> int:
        """k when the penalised rows are 0 .. k - 1 (no gather and scatter needed), else -1."""
        k = int(self.rows.shape[0])
        return k if k and int(self.rows[-1]) == k - 1 else -1


@dataclass(frozen=True, eq=False)
class SamplingRows(Sequence[tuple]):
    """Row i is sampling_row(...)'s tuple (engine/sampler.py): (temperature, top_p, top_k, min_p,
    seed, output_index, logprobs, logit_bias); indexing gives that tuple."""

    temperature: np.ndarray  # [num_rows] float64
    top_p: np.ndarray  # float64
    top_k: np.ndarray  # int64, <= 0 means off
    min_p: np.ndarray  # float64
    seeds: np.ndarray  # int64, the low 32 bits of each seed
    output_index: np.ndarray  # int64: tokens the request has generated so far
    logprobs: np.ndarray  # int64, NO_LOGPROBS where none are asked for
    logit_bias_rows: np.ndarray  # int64: the rows with a logit bias, ascending
    logit_bias: tuple[tuple[tuple[int, float], ...], ...]  # their (token id, bias) pairs
    penalties: PenaltyRows | None = None  # None: no row has a penalty or a min_tokens ban

    @classmethod
    def from_tuples(cls, rows: Sequence[tuple]) -> "SamplingRows":
        """From sampling_row(...) tuples."""
        if not rows:
            empty_float, empty_int = np.zeros(0), np.zeros(0, dtype=np.int64)
            return cls(empty_float, empty_float, empty_int, empty_float, empty_int, empty_int, empty_int, empty_int, ())
        temperature, top_p, top_k, min_p, seeds, output_index, logprobs, logit_bias = zip(*rows)
        biased = [row for row, pairs in enumerate(logit_bias) if pairs]
        return cls(np.array(temperature, dtype=np.float64), np.array(top_p, dtype=np.float64),
                   np.array(top_k, dtype=np.int64), np.array(min_p, dtype=np.float64),
                   np.array([s & MASK32 for s in seeds], dtype=np.int64), np.array(output_index, dtype=np.int64),
                   np.array([NO_LOGPROBS if n is None else n for n in logprobs], dtype=np.int64),
                   np.array(biased, dtype=np.int64), tuple(logit_bias[row] for row in biased))

    def __len__(self) -> int:
        return int(self.temperature.shape[0])

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        bias_place = int(np.searchsorted(self.logit_bias_rows, index))
        has_bias = bias_place < self.logit_bias_rows.shape[0] and self.logit_bias_rows[bias_place] == index
        logprobs = int(self.logprobs[index])
        return (float(self.temperature[index]), float(self.top_p[index]), int(self.top_k[index]),
                float(self.min_p[index]), int(self.seeds[index]), int(self.output_index[index]),
                None if logprobs == NO_LOGPROBS else logprobs, self.logit_bias[bias_place] if has_bias else None)

    def __iter__(self) -> Iterator[tuple]:
        return (self[i] for i in range(len(self)))

    @property
    def max_logprobs(self) -> int | None:
        """The most top logprobs a row asks for; None when no row asks for logprobs."""
        asked = self.logprobs[self.logprobs != NO_LOGPROBS]
        return int(asked.max()) if asked.size else None

    def packed(self) -> np.ndarray:
        """[6, num_rows] float64 (exact for every field): temperature, top_p, min_p, top_k, seeds,
        output_index: the buffer SamplingBatch sends to the device in one copy."""
        return np.stack([self.temperature, self.top_p, self.min_p, self.top_k.astype(np.float64),
                         self.seeds.astype(np.float64), self.output_index.astype(np.float64)])
