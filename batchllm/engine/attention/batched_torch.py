"""The `torch` attention backend (the CPU default): the reference math (ops.reference, the oracle)
batched into a few padded `scaled_dot_product_attention` calls per layer (docs/design.md, "The engine
and the model runner")."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.nn.functional as F

from batchllm.engine.attention.protocol import AttentionMetadata
from batchllm.engine.step_inputs import StepInputs
from batchllm.ops.kv_quant import check_kv_scales, decode_kv
from batchllm.ops.reference import store_kv_reference
from batchllm.ops.transfer import Upload, upload_arrays

# A padded batch may cost at most this many times the attention work of its seqs alone.
_MAX_PADDING_FACTOR = 2.0


@dataclass(frozen=True)
class HostBatch:
    """Seqs padded to [num_seqs, max_q_len] rows and [num_seqs, max_kv_len] KV positions (numpy)."""

    rows: np.ndarray  # [S, Q] int64: the query row of each padded row (0 for padding)
    row_valid: np.ndarray  # [S, Q] bool
    kv_slots: np.ndarray  # [S, L] int64 cache slots (0 for padding)
    visible: np.ndarray  # [S, Q, L] bool: causal and valid (no window)
    q_positions: np.ndarray  # [S, Q] int64
    kv_positions: np.ndarray  # [L] int64


@dataclass
class PaddedBatch:
    """A HostBatch on the device, with its masks."""

    rows: torch.Tensor
    row_valid: torch.Tensor
    kv_slots: torch.Tensor
    visible: torch.Tensor
    q_positions: torch.Tensor
    kv_positions: torch.Tensor
    masks: dict  # sliding window (None: none) -> [S, 1, Q * G, L] bool, built on first use

    def mask(self, window: int | None, group: int) -> torch.Tensor:
        if window not in self.masks:
            visible = self.visible
            if window is not None:
                visible = visible & (self.kv_positions[None, None, :] > self.q_positions[:, :, None] - window)
            # Padded rows see position 0 so that no softmax is empty (their output is dropped).
            visible = visible | (~self.row_valid[:, :, None] & (self.kv_positions == 0)[None, None, :])
            self.masks[window] = visible.repeat_interleave(group, dim=1)[:, None]
        return self.masks[window]


def _batches_of(q_lens: np.ndarray, kv_lens: np.ndarray) -> list[np.ndarray]:
    """Seq indices cut into batches sorted by (q_len, kv_len), each padded to at most
    _MAX_PADDING_FACTOR times the q_len * kv_len work of its seqs."""
    order = np.lexsort((kv_lens, q_lens))
    batches: list[list[int]] = []
    work = max_q = max_kv = 0
    for s in order:
        q, kv = int(q_lens[s]), int(kv_lens[s])
        grown_q, grown_kv = max(max_q, q), max(max_kv, kv)
        if batches and (len(batches[-1]) + 1) * grown_q * grown_kv <= _MAX_PADDING_FACTOR * (work + q * kv):
            batches[-1].append(s)
            work, max_q, max_kv = work + q * kv, grown_q, grown_kv
        else:
            batches.append([s])
            work, max_q, max_kv = q * kv, q, kv
    return [np.asarray(b, dtype=np.int64) for b in batches]


def _build_batch(inputs: StepInputs, seqs: np.ndarray, block_size: int) -> HostBatch:
    starts = inputs.query_start_loc.astype(np.int64)
    q_lens = (starts[seqs + 1] - starts[seqs])
    seq_lens = inputs.seq_lens[seqs].astype(np.int64)
    offsets = np.arange(q_lens.max())[None, :]
    row_valid = offsets < q_lens[:, None]
    rows = np.where(row_valid, starts[seqs][:, None] + offsets, 0)
    q_positions = seq_lens[:, None] - q_lens[:, None] + offsets
    slots, kv_valid = _padded_slots(inputs.block_tables[seqs], seq_lens, inputs.shared_kv_lens[seqs].astype(np.int64),
                                    block_size)
    kv_positions = np.arange(slots.shape[1])
    visible = (kv_positions[None, None, :] <= q_positions[:, :, None]) & kv_valid[:, None, :] & row_valid[:, :, None]
    return HostBatch(rows, row_valid, slots, visible, q_positions, kv_positions)


def _padded_slots(block_tables: np.ndarray, seq_lens: np.ndarray, shared: np.ndarray,
                  block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """KV cache slots of every position of every seq: [S, max_len] int64 and a validity mask."""
    max_len = int(seq_lens.max()) if seq_lens.size else 0
    positions = np.arange(max_len)[None, :]  # [1, L]
    own = positions - shared[:, None]
    num_shared_blocks = -(-shared // block_size)
    block_index = np.where(own < 0, positions // block_size, num_shared_blocks[:, None] + np.maximum(own, 0) // block_size)
    offset = np.where(own < 0, positions % block_size, np.maximum(own, 0) % block_size)
    valid = positions < seq_lens[:, None]
    block_index = np.where(valid, block_index, 0)
    rows = np.arange(block_tables.shape[0])[:, None]
    slots = block_tables[rows, block_index].astype(np.int64) * block_size + offset
    return np.where(valid, slots, 0), valid


class BatchedTorchBackend:
    supports_cuda_graphs = False

    def __init__(self, block_size: int, layer_windows: tuple[int | None, ...] = ()) -> None:
        self.block_size = block_size
        self.layer_windows = tuple(layer_windows)

    def build_plan(self, inputs: StepInputs) -> tuple[HostBatch, ...]:
        q_lens = np.diff(inputs.query_start_loc.astype(np.int64))
        active = np.flatnonzero(q_lens > 0)
        return tuple(_build_batch(inputs, active[b], self.block_size)
                     for b in _batches_of(q_lens[active], inputs.seq_lens[active]))

    def plan_to_device(self, plan: tuple[HostBatch, ...], device: torch.device,
                       upload: Upload | None = None) -> tuple[PaddedBatch, ...]:
        names = [f.name for f in fields(HostBatch)]
        batches = []
        for batch in plan:
            arrays = {name: getattr(batch, name) for name in names}
            tensors = upload(arrays) if upload is not None else upload_arrays(arrays, device)
            batches.append(PaddedBatch(**tensors, masks={}))
        return tuple(batches)

    def store(self, key, value, k_cache, v_cache, metadata: AttentionMetadata, k_scale: float = 1.0,
              v_scale: float = 1.0) -> None:
        store_kv_reference(key, value, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale)

    def attend(self, query, k_cache, v_cache, metadata: AttentionMetadata[tuple[PaddedBatch, ...]], scale: float,
               window: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
               out: torch.Tensor | None = None) -> torch.Tensor:
        # query: [num_tokens, num_heads, head_dim]; a float8_e4m3fn cache is dequantized per batch
        check_kv_scales(k_scale, v_scale, k_cache.dtype)
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        group = query.shape[1] // num_kv_heads
        flat_k = k_cache.view(-1, num_kv_heads, head_dim)
        flat_v = v_cache.view(-1, num_kv_heads, head_dim)
        out = torch.empty_like(query) if out is None else out
        for batch in metadata.plan:
            num_seqs, max_q = batch.rows.shape
            # [S, Q, Hkv, G, D] -> [S, Hkv, Q * G, D]: the G query heads of a KV head as extra rows.
            q = query[batch.rows].float().view(num_seqs, max_q, num_kv_heads, group, head_dim)
            q = q.transpose(1, 2).reshape(num_seqs, num_kv_heads, max_q * group, head_dim)
            slots = batch.kv_slots.view(-1)
            kv_shape = (num_seqs, -1, num_kv_heads, head_dim)
            k = decode_kv(flat_k.index_select(0, slots), k_scale).view(kv_shape).transpose(1, 2)
            v = decode_kv(flat_v.index_select(0, slots), v_scale).view(kv_shape).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.mask(window, group), scale=scale)
            o = o.view(num_seqs, num_kv_heads, max_q, group, head_dim).transpose(1, 2)  # [S, Q, Hkv, G, D]
            o = o.reshape(num_seqs, max_q, -1, head_dim)
            out[batch.rows[batch.row_valid]] = o[batch.row_valid].to(query.dtype)
        return out
