"""PyTorch attention for the CPU path: the reference math, batched for speed.

`ops.reference.paged_attention_reference` stays the oracle (one seq at a time, float32). This
backend computes the same thing faster: the KV slot indices are built once per step (not per
layer), decode rows of all seqs run as one batched matmul, and prefill chunks use SDPA.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from batchllm.engine.step_inputs import StepInputs
from batchllm.ops import reference


class _StepPlan:
    def __init__(self, inputs: StepInputs, block_size: int, device: torch.device) -> None:
        starts = inputs.query_start_loc
        q_lens = np.diff(starts)
        seq_lens = inputs.seq_lens.astype(np.int64)
        shared = inputs.shared_kv_lens.astype(np.int64)
        decode = np.flatnonzero(q_lens == 1)
        self.decode_rows = torch.from_numpy(starts[:-1][decode].astype(np.int64)).to(device)
        self.decode_kv_slots, self.decode_kv_valid = _padded_slots(
            inputs.block_tables[decode], seq_lens[decode], shared[decode], block_size, device)
        self.prefill = []  # (row_begin, row_end, kv_slots [kv_len])
        for s in np.flatnonzero(q_lens > 1):
            slots, _ = _padded_slots(inputs.block_tables[s:s + 1], seq_lens[s:s + 1], shared[s:s + 1],
                                     block_size, device)
            self.prefill.append((int(starts[s]), int(starts[s + 1]), slots[0]))


def _padded_slots(block_tables: np.ndarray, seq_lens: np.ndarray, shared: np.ndarray, block_size: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
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
    slots = np.where(valid, slots, 0)
    return torch.from_numpy(slots).to(device), torch.from_numpy(valid).to(device)


class BatchedTorchBackend:
    name = "torch"

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def prepare(self, inputs: StepInputs, metadata) -> None:
        metadata.plan = _StepPlan(inputs, self.block_size, metadata.slot_mapping.device)

    def store(self, key, value, k_cache, v_cache, metadata) -> None:
        reference.store_kv_reference(key, value, k_cache, v_cache, metadata.slot_mapping)

    def attend(self, query, k_cache, v_cache, metadata, scale: float) -> torch.Tensor:
        # query: [num_tokens, num_heads, head_dim]
        plan: _StepPlan = metadata.plan
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        group = query.shape[1] // num_kv_heads
        flat_k = k_cache.view(-1, num_kv_heads, head_dim)
        flat_v = v_cache.view(-1, num_kv_heads, head_dim)
        out = torch.empty_like(query)
        if plan.decode_rows.numel():
            q = query[plan.decode_rows].float().view(-1, num_kv_heads, group, head_dim)  # [S, Hkv, G, D]
            k = flat_k[plan.decode_kv_slots].float()  # [S, L, Hkv, D]
            v = flat_v[plan.decode_kv_slots].float()
            scores = torch.einsum("shgd,slhd->shgl", q, k) * scale
            scores = scores.masked_fill(~plan.decode_kv_valid[:, None, None, :], float("-inf"))
            probs = scores.softmax(dim=-1)
            out[plan.decode_rows] = torch.einsum("shgl,slhd->shgd", probs, v).reshape(-1, query.shape[1], head_dim).to(query.dtype)
        for row_begin, row_end, slots in plan.prefill:
            q = query[row_begin:row_end].float().transpose(0, 1)  # [H, q_len, D]
            k = flat_k[slots].float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, kv_len, D]
            v = flat_v[slots].float().repeat_interleave(group, dim=1).transpose(0, 1)
            q_len, kv_len = q.shape[1], k.shape[1]
            mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(diagonal=kv_len - q_len)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            out[row_begin:row_end] = o.transpose(0, 1).to(query.dtype)
        return out
