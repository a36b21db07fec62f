"""One Triton pass for sampling penalties (engine/penalties.py): each row of the step's logits is
read once, and a penalised row's counts and prompt marks are read from its slot of the count
table, so the penalties cost about one read and one write of the logits whatever the rows hold
(the PyTorch form, engine/penalties.apply_penalties, runs a dozen [rows, vocab] kernels).
`penalize_rows_reference` is the same computation in PyTorch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _penalize_kernel(
    logits_ptr, out_ptr,  # [num_rows, vocab] float32
    penalty_index_ptr,  # [num_rows] int32: the row's entry of the penalty arrays, -1 none
    slots_ptr,  # [k] int64
    presence_ptr, frequency_ptr, repetition_ptr,  # [k] float32
    counts_ptr,  # [num_slots, vocab] int16
    seen_ptr,  # [num_slots, vocab] uint8
    vocab_size, stride_logits, stride_out, stride_counts, stride_seen,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < vocab_size
    x = tl.load(logits_ptr + row * stride_logits + offs, mask=mask)
    entry = tl.load(penalty_index_ptr + row)
    if entry >= 0:
        slot = tl.load(slots_ptr + entry).to(tl.int64)
        count = tl.load(counts_ptr + slot * stride_counts + offs, mask=mask, other=0).to(tl.float32)
        seen = tl.load(seen_ptr + slot * stride_seen + offs, mask=mask, other=0)
        repetition = tl.load(repetition_ptr + entry)
        generated = count > 0
        repeated = tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition)
        x = tl.where(generated | (seen != 0), repeated, x)
        frequency_term = tl.load(frequency_ptr + entry) * count
        presence_term = tl.load(presence_ptr + entry) * generated.to(tl.float32)
        x = (x - frequency_term) - presence_term
    tl.store(out_ptr + row * stride_out + offs, x, mask=mask)


def penalize_rows(logits: torch.Tensor, penalty_index: torch.Tensor, slots: torch.Tensor, presence: torch.Tensor,
                  frequency: torch.Tensor, repetition: torch.Tensor, counts: torch.Tensor,
                  prompt_seen: torch.Tensor) -> torch.Tensor:
    """logits [num_rows, vocab] float32 -> a new tensor: row r penalised with entry
    e = penalty_index[r] (slot slots[e] of counts / prompt_seen, penalties [e]) when e >= 0,
    copied otherwise."""
    num_rows, vocab_size = logits.shape
    out = torch.empty_like(logits)
    if num_rows == 0:
        return out
    grid = (num_rows, triton.cdiv(vocab_size, _BLOCK))
    _penalize_kernel[grid](logits, out, penalty_index, slots, presence, frequency, repetition, counts,
                           prompt_seen.view(torch.uint8), vocab_size, logits.stride(0), out.stride(0),
                           counts.stride(0), prompt_seen.stride(0), BLOCK=_BLOCK)
    return out


def penalize_rows_reference(logits: torch.Tensor, penalty_index: torch.Tensor, slots: torch.Tensor,
                            presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor,
                            counts: torch.Tensor, prompt_seen: torch.Tensor) -> torch.Tensor:
    """penalize_rows in PyTorch."""
    penalised = penalty_index >= 0
    entry = penalty_index.clamp(min=0).long()
    slot = slots[entry]
    count = counts.index_select(0, slot).to(logits.dtype)
    generated = count > 0
    repetition = repetition[entry][:, None]
    repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
    out = torch.where(generated | prompt_seen.index_select(0, slot), repeated, logits)
    out = out - frequency[entry][:, None] * count - presence[entry][:, None] * generated.to(logits.dtype)
    return torch.where(penalised[:, None], out, logits)
