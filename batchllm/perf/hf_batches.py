"""How the HF generate peer batches a workload, as HF users batch prompts: requests of equal
prompt length together (no padding, no attention mask), the leftovers of each length pooled,
sorted by length and left-padded. Every member of a static batch generates the batch's longest
max_tokens. Also the steps such a batch runs, for the roofline. Torch-free."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from batchllm.perf.roofline import StepWork, chunk_attended_keys


@dataclass(frozen=True)
class PeerBatch:
    request_indices: tuple[int, ...]
    width: int  # prompt tokens per row after left padding (the longest member's prompt)
    max_new_tokens: int  # the longest member's max_tokens
    padded: bool  # some member is shorter than width: left padding and an attention mask

    @property
    def num_rows(self) -> int:
        return len(self.request_indices)

    @property
    def shape(self) -> tuple[int, int, int, bool]:
        """What a warm-up must match: rows, width, new tokens, mask."""
        return (self.num_rows, self.width, self.max_new_tokens, self.padded)


def _batch(indices: Sequence[int], prompt_lengths: Sequence[int], max_tokens: Sequence[int]) -> PeerBatch:
    lengths = [prompt_lengths[i] for i in indices]
    return PeerBatch(tuple(indices), max(lengths), max(max_tokens[i] for i in indices), min(lengths) != max(lengths))


def plan_peer_batches(prompt_lengths: Sequence[int], max_tokens: Sequence[int], batch_size: int,
                      num_requests: int) -> list[PeerBatch]:
    """Batches of at most batch_size requests that cover at least the first num_requests
    requests, whole batches only, in the order of their first request. Requests of one prompt
    length fill batches in request order; each length's last incomplete batch goes to a pool
    that is sorted by length and cut into padded batches (one length only: no padding)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    by_length: dict[int, list[int]] = {}
    for index, length in enumerate(prompt_lengths):
        by_length.setdefault(length, []).append(index)
    batches: list[PeerBatch] = []
    leftovers: list[int] = []
    for indices in by_length.values():
        num_full = len(indices) // batch_size * batch_size
        batches += [_batch(indices[start:start + batch_size], prompt_lengths, max_tokens)
                    for start in range(0, num_full, batch_size)]
        leftovers += indices[num_full:]
    leftovers.sort(key=lambda index: (prompt_lengths[index], index))
    batches += [_batch(leftovers[start:start + batch_size], prompt_lengths, max_tokens)
                for start in range(0, len(leftovers), batch_size)]
    wanted = min(num_requests, len(prompt_lengths))
    chosen = [batch for batch in batches if min(batch.request_indices) < wanted]
    return sorted(chosen, key=lambda batch: min(batch.request_indices))


def static_batch_steps(batch: PeerBatch) -> list[StepWork]:
    """The steps of one `generate` call: a prefill of every row (padding included), then one
    decode step per further new token; every row keeps its whole (padded) KV."""
    rows, width = batch.num_rows, batch.width
    steps = [StepWork(rows * width, rows * chunk_attended_keys(0, width), rows, rows * width)]
    for step in range(1, batch.max_new_tokens):
        kv_len = width + step  # the fed-back token at position width + step - 1, stored, then attended
        steps.append(StepWork(rows, rows * kv_len, rows, rows * kv_len))
    return steps


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """--hf-peer: '64,128' -> (64, 128), '64' -> (64,), '0' -> () (no peer); repeats dropped."""
    parts = [part.strip() for part in str(text).split(",") if part.strip()]
    try:
        sizes = [int(part) for part in parts]
    except ValueError:
        raise ValueError(f"bad --hf-peer {text!r}: a batch size or a comma list of them, e.g. 64,128") from None
    if sizes == [0]:
        return ()
    if not sizes or any(size < 1 for size in sizes):
        raise ValueError(f"bad --hf-peer {text!r}: batch sizes must be at least 1 (0 alone: no peer)")
    return tuple(dict.fromkeys(sizes))
