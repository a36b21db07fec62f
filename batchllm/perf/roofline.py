"""A lower bound on a run's time from its steps: the sum over steps of max(FLOPs of the step / the
matmul peak, bytes the step must read / the memory bandwidth). Beside the FLOP bound
(flop_bound.py), which sees only arithmetic, it charges a decode step for reading every weight
and the KV cache it attends. Torch-free; `arch` is a ModelArchConfig (num_params, num_layers,
num_heads, head_dim, vocab_size, hidden_size).

What one step counts (StepWork; step_work derives it from the step's ScheduledChunks):
- FLOPs, as work_flops counts them for the whole work: 2 x non-embedding parameters per computed
  row, 4 x layers x heads x head_dim per (row, attended key) pair (QK^T and PV; a row at position
  p attends p + 1 keys), and 2 x vocab x hidden per sampled row (the LM head).
- bytes read:
  - the decoder's weights once: num_params(include_embeddings=False) x bytes per weight element
    (1 for an engine with FP8 linear layers, else the dtype's size; the norms, which stay in the
    model dtype, are counted at that size too, which only lowers the bound);
  - the LM head once when some row of the step samples: vocab x hidden x the dtype's size;
  - the KV cache: every KV position some row of the step attends, kv_bytes_per_token each (K and
    V of every layer and KV head, once per step). A sequence reads its own positions
    [0, kv_len), the step's new tokens included (they are stored to the cache and read back).
    A prefix-sharing group (the batchllm policy's chunks with a group_id) reads its shared prefix
    once for the whole group, as the prefix-shared attention does, and each member its own
    positions after it. Chunks without a group (the vllm and sglang policies, whose cached prefix
    blocks each request's attention reads itself) count their whole KV each.
  Left out, so the bound stays a lower bound: writes (the new KV, activations, logits),
  activations and embedding rows read, FP8 scales, and every re-read of data that did not stay
  in on-chip memory.
Attention is counted as full in every layer (as work_flops does): a sliding-window model reads
and computes less there.

The serial roofline charges the two parts of a step one after the other: the linear layers and
the LM head (their FLOPs, the weights read) and attention (its FLOPs, the KV read), each at its
own max(FLOPs / peak, bytes / bandwidth). In every layer the engine runs attention between the
QKV and output projections, kernel after kernel, so a step of this engine cannot take less: a
mixed step's GEMMs are bound by arithmetic while its decode rows' attention is bound by reading
KV, and the plain roofline lets the one hide the other. It is a bound for kernels that run in
sequence, not for every possible implementation (a kernel overlapping the two would go below it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from batchllm.perf.flop_bound import H200_BF16_PEAK_FLOPS
from batchllm.sched.interface import NO_GROUP, ScheduledChunk, ScheduledChunks

# bytes read + bytes written per second of a large device-to-device copy on an H200 (the copy
# ceiling the attention benchmarks of BENCHMARKS.md reach, ~4.2 TB/s). Reads alone at this rate
# take no less time than the reads and writes of a real step.
H200_COPY_BANDWIDTH_BYTES_PER_S = 4.2e12


@dataclass(frozen=True)
class StepWork:
    """The work of one step that the roofline charges."""

    num_tokens: int  # query rows computed
    num_attended_keys: int  # sum over the rows of the keys each attends
    num_sampled_rows: int  # rows whose logits are computed
    num_kv_tokens_read: int  # KV positions read from the cache (a group's shared prefix once)


@dataclass(frozen=True)
class TrafficModel:
    """Bytes per element of what a step reads."""

    weight_bytes_per_element: int  # decoder linear layers: 1 for FP8, else the dtype's size
    lm_head_bytes_per_element: int  # the model dtype's size (the LM head is never FP8)
    kv_bytes_per_token: int  # K and V of one token, every layer and KV head


@dataclass(frozen=True)
class Roofline:
    seconds: float
    num_memory_bound_steps: int  # steps whose bytes take longer than their FLOPs
    serial_seconds: float  # the linear part and the attention part of each step at their own roofline, added


def chunk_attended_keys(start_position: int, num_tokens: int) -> int:
    """Keys attended by rows at positions start .. start + num_tokens - 1 (causal: p + 1 each)."""
    return num_tokens * start_position + num_tokens * (num_tokens + 1) // 2


def step_work(chunks: Iterable[ScheduledChunk]) -> StepWork:
    """The StepWork of one scheduled step (SchedulerOutput.chunks)."""
    if isinstance(chunks, ScheduledChunks):
        return _step_work_columns(chunks)
    num_tokens = attended = sampled = own_kv = 0
    group_prefix_len: dict[int, int] = {}  # group -> shared prefix positions the step reads
    for chunk in chunks:
        num_tokens += chunk.num_tokens
        attended += chunk_attended_keys(chunk.start_position, chunk.num_tokens)
        sampled += int(chunk.sample)
        if chunk.group_id == NO_GROUP:
            own_kv += chunk.kv_len
            continue
        visible_prefix = chunk.kv_len if chunk.is_prefix else chunk.shared_kv_len
        group_prefix_len[chunk.group_id] = max(group_prefix_len.get(chunk.group_id, 0), visible_prefix)
        if not chunk.is_prefix:
            own_kv += chunk.kv_len - chunk.shared_kv_len
    return StepWork(num_tokens, attended, sampled, own_kv + sum(group_prefix_len.values()))


def _step_work_columns(chunks: ScheduledChunks) -> StepWork:
    """step_work over the chunk columns (the same sums, as array operations)."""
    num_tokens, starts, shared = chunks.num_tokens, chunks.start_positions, chunks.shared_kv_lens
    kv_lens = starts + num_tokens
    attended = int((num_tokens * starts + num_tokens * (num_tokens + 1) // 2).sum())
    grouped = chunks.group_ids != NO_GROUP
    own_kv = int(kv_lens[~grouped].sum()) + int((kv_lens - shared)[grouped & ~chunks.is_prefix].sum())
    prefix_kv = 0
    if grouped.any():  # each group's prefix once: the most of it any of its chunks sees
        visible = np.where(chunks.is_prefix, kv_lens, shared)[grouped]
        group_index = np.unique(chunks.group_ids[grouped], return_inverse=True)[1].reshape(-1)
        most = np.zeros(int(group_index.max()) + 1, dtype=np.int64)
        np.maximum.at(most, group_index, visible)
        prefix_kv = int(most.sum())
    return StepWork(int(num_tokens.sum()), attended, int(chunks.sample.sum()), own_kv + prefix_kv)


def step_flop_parts(arch, work: StepWork) -> tuple[float, float]:
    """(the linear layers' and the LM head's FLOPs, attention's FLOPs) of one step."""
    linear = (2.0 * arch.num_params(include_embeddings=False) * work.num_tokens
              + 2.0 * arch.vocab_size * arch.hidden_size * work.num_sampled_rows)
    return linear, 4.0 * arch.num_layers * arch.num_heads * arch.head_dim * work.num_attended_keys


def step_byte_parts(arch, traffic: TrafficModel, work: StepWork) -> tuple[float, float]:
    """(the weights and the LM head read, the KV read) of one step."""
    weights = float(arch.num_params(include_embeddings=False) * traffic.weight_bytes_per_element)
    if work.num_sampled_rows:
        weights += arch.vocab_size * arch.hidden_size * traffic.lm_head_bytes_per_element
    return weights, float(work.num_kv_tokens_read) * traffic.kv_bytes_per_token


def step_flops(arch, work: StepWork) -> float:
    return sum(step_flop_parts(arch, work))


def step_bytes_read(arch, traffic: TrafficModel, work: StepWork) -> float:
    return sum(step_byte_parts(arch, traffic, work))


def roofline(arch, steps: Sequence[StepWork], traffic: TrafficModel, peak_flops: float = H200_BF16_PEAK_FLOPS,
             bandwidth_bytes_per_s: float = H200_COPY_BANDWIDTH_BYTES_PER_S) -> Roofline:
    """Sum over steps of max(step_flops / peak_flops, step_bytes_read / bandwidth_bytes_per_s), and
    the serial roofline (the module docstring)."""
    if peak_flops <= 0 or bandwidth_bytes_per_s <= 0:
        raise ValueError(f"peak_flops and bandwidth must be positive, got {peak_flops} and {bandwidth_bytes_per_s}")
    seconds, serial, memory_bound = 0.0, 0.0, 0
    for work in steps:
        flops, read = step_flop_parts(arch, work), step_byte_parts(arch, traffic, work)
        compute_s, memory_s = sum(flops) / peak_flops, sum(read) / bandwidth_bytes_per_s
        seconds += max(compute_s, memory_s)
        serial += sum(max(f / peak_flops, r / bandwidth_bytes_per_s) for f, r in zip(flops, read))
        memory_bound += memory_s > compute_s
    return Roofline(seconds, memory_bound, serial)
