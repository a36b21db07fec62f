"""Presence, frequency and repetition penalties and min_tokens bans, on the device (docs/design.md,
"Sampling penalties").

A penalised request holds a slot of a device-resident table: per slot, how often each vocab id was
sampled (int16, saturating at COUNT_MAX) and whether it is in the prompt. Each step gathers its
penalised rows' slots and applies the penalties in a few elementwise ops over [rows, vocab], then
adds the sampled ids to the counts: no per-request host work, no upload of earlier tokens. On a
GPU the penalties run as one Triton pass over the logits (ops/penalty_kernels.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchllm.engine.sampling_rows import PenaltyRows
from batchllm.ops.penalty_kernels import penalize_rows
from batchllm.ops.transfer import Upload, upload_arrays

COUNT_MAX = torch.iinfo(torch.int16).max  # a count stays here once reached


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, prompt_seen: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """logits [k, vocab] float32, counts [k, vocab] (times each id was generated), prompt_seen
    [k, vocab] bool, penalties [k] float32 -> the penalised logits (a new tensor), as vLLM applies
    them: the repetition penalty on every id of the prompt or the output (a positive logit divided
    by it, another multiplied), then logit -= frequency * count + presence * (count > 0)."""
    generated = counts > 0
    repetition = repetition[:, None]
    repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(generated | prompt_seen, repeated, logits)
    return logits - frequency[:, None] * counts.to(logits.dtype) - presence[:, None] * generated.to(logits.dtype)


@dataclass(frozen=True)
class PenaltyBatch:
    """A step's PenaltyRows on the device."""

    rows: torch.Tensor  # int64 [k]
    slots: torch.Tensor  # int64 [k]
    presence: torch.Tensor  # float32 [k]
    frequency: torch.Tensor  # float32 [k]
    repetition: torch.Tensor  # float32 [k]
    leading_rows: int  # k when rows are 0 .. k - 1 (sliced, not gathered), else -1
    penalty_index: torch.Tensor  # int32 [num_rows]: each row's entry of the arrays above, -1 none
    num_slots: int
    new_slots: torch.Tensor | None  # int64; None: no slot starts this step
    prompt_slots: torch.Tensor | None
    prompt_token_ids: torch.Tensor | None
    ban_rows: torch.Tensor | None  # int64; None: no row is banned anything
    ban_token_ids: torch.Tensor | None

    @classmethod
    def build(cls, rows: PenaltyRows, num_rows: int, device: torch.device,
              upload: Upload | None = None) -> PenaltyBatch:
        """num_rows: the step's sampled rows. upload: how the arrays travel (the runner's
        PinnedStaging.upload); None: one-off copies."""
        penalty_index = np.full(num_rows, -1, dtype=np.int32)
        penalty_index[rows.rows] = np.arange(rows.rows.shape[0], dtype=np.int32)
        arrays = {"rows": rows.rows, "slots": rows.slots, "presence": rows.presence, "frequency": rows.frequency,
                  "repetition": rows.repetition, "penalty_index": penalty_index}
        if rows.new_slots.size:
            arrays.update(new_slots=rows.new_slots, prompt_slots=rows.prompt_slots,
                          prompt_token_ids=rows.prompt_token_ids)
        if rows.ban_rows.size:
            arrays.update(ban_rows=rows.ban_rows, ban_token_ids=rows.ban_token_ids)
        arrays = {name: np.ascontiguousarray(array) for name, array in arrays.items()}
        on_device = upload(arrays) if upload is not None else upload_arrays(arrays, device)
        return cls(on_device["rows"], on_device["slots"], on_device["presence"], on_device["frequency"],
                   on_device["repetition"], rows.leading_rows, on_device["penalty_index"], rows.num_slots,
                   on_device.get("new_slots"), on_device.get("prompt_slots"), on_device.get("prompt_token_ids"),
                   on_device.get("ban_rows"), on_device.get("ban_token_ids"))

    @property
    def num_rows(self) -> int:
        return int(self.rows.shape[0])


class PenaltyTable:
    """The device's counts and prompt marks, one row per slot (the host's RequestColumns hands
    the slots out and takes them back). Memory: 3 bytes x vocab per slot (int16 count + bool
    mark); it grows by doubling to the most penalised requests running at once."""

    def __init__(self, device: torch.device, use_triton: bool | None = None) -> None:
        """use_triton: penalise through the Triton kernel (None: on a CUDA device)."""
        self.device = device
        self.use_triton = device.type == "cuda" if use_triton is None else use_triton
        self.counts: torch.Tensor | None = None  # [num_slots, vocab] int16
        self.prompt_seen: torch.Tensor | None = None  # [num_slots, vocab] bool

    @property
    def num_bytes(self) -> int:
        if self.counts is None:
            return 0
        return self.counts.numel() * self.counts.element_size() + self.prompt_seen.numel()

    def _fit(self, num_slots: int, vocab_size: int) -> None:
        held = 0 if self.counts is None else self.counts.shape[0]
        if self.counts is not None and self.counts.shape[1] != vocab_size:
            raise ValueError(f"the penalty table holds {self.counts.shape[1]} vocab ids, the logits {vocab_size}")
        if num_slots <= held:
            return
        capacity = max(num_slots, 2 * held, 8)
        counts = torch.zeros(capacity, vocab_size, dtype=torch.int16, device=self.device)
        prompt_seen = torch.zeros(capacity, vocab_size, dtype=torch.bool, device=self.device)
        if held:
            counts[:held] = self.counts
            prompt_seen[:held] = self.prompt_seen
        self.counts, self.prompt_seen = counts, prompt_seen

    def apply(self, logits: torch.Tensor, batch: PenaltyBatch) -> torch.Tensor:
        """The step's logits with the min_tokens bans at -inf and the penalties applied to the
        penalised rows (a new tensor); starts the step's new slots first."""
        if batch.ban_rows is not None:
            vocab_size = logits.shape[-1]
            in_vocab = batch.ban_token_ids < vocab_size  # an id past the logits bans nothing
            token_ids = batch.ban_token_ids.masked_fill(~in_vocab, 0)
            bans = torch.where(in_vocab, float("-inf"), 0.0).to(logits.dtype)
            logits = logits.index_put((batch.ban_rows, token_ids), bans, accumulate=True)
        if not batch.num_rows:
            return logits
        self._fit(batch.num_slots, logits.shape[-1])
        if batch.new_slots is not None:
            self.counts.index_fill_(0, batch.new_slots, 0)
            self.prompt_seen.index_fill_(0, batch.new_slots, False)
            self.prompt_seen.index_put_((batch.prompt_slots, batch.prompt_token_ids),
                                        torch.ones((), dtype=torch.bool, device=logits.device))
        if self.use_triton:
            return penalize_rows(logits, batch.penalty_index, batch.slots, batch.presence, batch.frequency,
                                 batch.repetition, self.counts, self.prompt_seen)
        counts = self.counts.index_select(0, batch.slots)
        prompt_seen = self.prompt_seen.index_select(0, batch.slots)
        if batch.leading_rows == logits.shape[0]:  # every row is penalised
            return apply_penalties(logits, counts, prompt_seen, batch.presence, batch.frequency, batch.repetition)
        if batch.leading_rows > 0:
            rows = logits[:batch.leading_rows]
        else:
            rows = logits.index_select(0, batch.rows)
        penalised = apply_penalties(rows, counts, prompt_seen, batch.presence, batch.frequency, batch.repetition)
        return logits.index_copy(0, batch.rows, penalised)

    def count(self, batch: PenaltyBatch, token_ids: torch.Tensor) -> None:
        """Add each penalised row's sampled id to its slot's counts (a slot samples once a step)."""
        if not batch.num_rows:
            return
        sampled = token_ids[:batch.leading_rows] if batch.leading_rows > 0 else token_ids.index_select(0, batch.rows)
        place = (batch.slots, sampled)
        self.counts.index_put_(place, self.counts[place].clamp_(max=COUNT_MAX - 1) + 1)  # no int16 wrap-around
