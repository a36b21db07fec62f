"""Plain PyTorch references for the paged-KV operators: the kernels' test oracles and the
engine's `reference` attention backend.

Layouts are those of the kernels; KV position p of a seq lives where the addressing rule of
docs/design.md ("KV addressing") puts it. Row i of a seq with q_len rows sits at position
seq_len - q_len + i and attends KV positions <= its own (causal); with a sliding window W, only
positions > its own - W (HF transformers' sliding-window mask: the last W positions, itself included).
A float8_e4m3fn cache holds values quantized by the rule of kv_quant.py, with one scale for K and
one for V; the math dequantizes them to float32.
"""

from __future__ import annotations

import torch

from batchllm.ops.kv_quant import check_kv_scales, decode_kv, encode_kv


def store_kv_reference(key, value, k_cache, v_cache, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                       v_scale: float = 1.0) -> None:
    """kv_store.store_kv in PyTorch: the same arguments, the same in-place writes."""
    check_kv_scales(k_scale, v_scale, k_cache.dtype)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = encode_kv(key[keep], k_cache.dtype, k_scale)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = encode_kv(value[keep], v_cache.dtype, v_scale)


def kv_slots_of_seq(
    block_table: torch.Tensor,  # [max_blocks] int
    seq_len: int,
    shared_kv_len: int,
    block_size: int,
) -> torch.Tensor:
    """Cache slots of KV positions 0..seq_len-1 of one seq: [seq_len] int64."""
    positions = torch.arange(seq_len, device=block_table.device)
    num_shared_blocks = -(-shared_kv_len // block_size)
    own = positions - shared_kv_len
    block_index = torch.where(positions < shared_kv_len, positions // block_size,
                              num_shared_blocks + own.clamp(min=0) // block_size)
    offset = torch.where(positions < shared_kv_len, positions % block_size, own.clamp(min=0) % block_size)
    return block_table.long()[block_index] * block_size + offset


def paged_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    seq_lens: torch.Tensor,  # [num_seqs]
    shared_kv_lens: torch.Tensor,  # [num_seqs]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,  # a float8_e4m3fn cache's scales
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of every row over its seq's paged KV, one seq at a time, in float32;
    out [num_tokens, num_heads, head_dim] in the query dtype."""
    check_kv_scales(k_scale, v_scale, k_cache.dtype)
    num_heads, head_dim = query.shape[1:]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group_size = num_heads // num_kv_heads
    out = torch.empty_like(query)
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    shared = shared_kv_lens.tolist()
    for s in range(len(lens)):
        q_begin, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_begin
        if q_len == 0:
            continue
        kv_len = lens[s]
        slots = kv_slots_of_seq(block_tables[s], kv_len, shared[s], block_size)
        k = decode_kv(flat_k[slots], k_scale).repeat_interleave(group_size, dim=1)  # [kv_len, num_heads, d]
        v = decode_kv(flat_v[slots], v_scale).repeat_interleave(group_size, dim=1)
        q = query[q_begin:q_end].float()  # [q_len, num_heads, d]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [num_heads, q_len, kv_len]
        q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)
        mask = visible_kv(torch.arange(kv_len, device=query.device), q_pos, sliding_window)
        scores = scores.masked_fill(~mask, float("-inf"))
        seq_lse = torch.logsumexp(scores, dim=-1)  # [num_heads, q_len]
        probs = torch.exp(scores - seq_lse[..., None])
        out[q_begin:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


def visible_kv(kv_positions: torch.Tensor, q_positions: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """[q, kv] bool: which KV positions each query position attends (causal, and within the window)."""
    visible = kv_positions[None, :] <= q_positions[:, None]
    if sliding_window is not None:
        visible &= kv_positions[None, :] > q_positions[:, None] - sliding_window
    return visible
