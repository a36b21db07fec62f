"""Plain PyTorch references for the paged-KV operators (test oracles and the CPU path).

Layouts (shared by every kernel in this package):
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
  query, key, value rows of a step: [num_tokens, num_heads | num_kv_heads, head_dim]
  query_start_loc: [num_seqs + 1] int32  (rows of seq s are query_start_loc[s]:query_start_loc[s+1])
  seq_lens:        [num_seqs] int32      (KV positions visible to the seq's last row)
  shared_kv_lens:  [num_seqs] int32      (leading KV positions held in shared prefix blocks)
  block_tables:    [num_seqs, max_blocks] int32 (shared prefix blocks first, then own blocks)
  slot_mapping:    [num_tokens] int64    (block_id * block_size + offset of each new row)

KV position p of seq s lives in block
  block_tables[s, p // B]                                  if p <  shared_kv_lens[s]
  block_tables[s, ceil(shared / B) + (p - shared) // B]     otherwise (offset (p - shared) % B)
(see batchllm/sched/interface.py). Row i of a seq with q_len rows sits at position
seq_len - q_len + i and attends KV positions <= its own (causal).
"""

from __future__ import annotations

import torch


def store_kv_reference(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; negative = skip the row
) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = value[keep].to(v_cache.dtype)


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
    return_lse: bool = False,
):
    """Causal attention of every row over its seq's paged KV, one seq at a time, in float32.

    Returns out [num_tokens, num_heads, head_dim] (query dtype) and, with return_lse, the
    natural-log log-sum-exp of the scaled scores, [num_tokens, num_heads] float32.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group_size = num_heads // num_kv_heads
    out = torch.empty_like(query)
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float32, device=query.device)
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
        k = flat_k[slots].float().repeat_interleave(group_size, dim=1)  # [kv_len, num_heads, d]
        v = flat_v[slots].float().repeat_interleave(group_size, dim=1)
        q = query[q_begin:q_end].float()  # [q_len, num_heads, d]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [num_heads, q_len, kv_len]
        q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)
        mask = torch.arange(kv_len, device=query.device)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~mask, float("-inf"))
        seq_lse = torch.logsumexp(scores, dim=-1)  # [num_heads, q_len]
        probs = torch.exp(scores - seq_lse[..., None])
        out[q_begin:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
        lse[q_begin:q_end] = seq_lse.transpose(0, 1)
    if return_lse:
        return out, lse
    return out


def dense_causal_attention(
    query: torch.Tensor,  # [q_len, num_heads, d]
    key: torch.Tensor,  # [kv_len, num_kv_heads, d]
    value: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Contiguous causal attention (the last q_len of kv_len positions): an oracle for the paged one."""
    group_size = query.shape[1] // key.shape[1]
    k = key.float().repeat_interleave(group_size, dim=1)
    v = value.float().repeat_interleave(group_size, dim=1)
    q_len, kv_len = query.shape[0], key.shape[0]
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale
    mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal=kv_len - q_len)
    scores = scores.masked_fill(~mask.to(scores.device), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)


def merge_attention_states_reference(
    out_a: torch.Tensor,  # [num_tokens, num_heads, d]
    lse_a: torch.Tensor,  # [num_tokens, num_heads] natural log; -inf = empty part
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
):
    """Merge two partial attentions over disjoint KV sets by log-sum-exp (natural log)."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w_a = torch.exp(lse_a - safe).nan_to_num(0.0)[..., None]
    w_b = torch.exp(lse_b - safe).nan_to_num(0.0)[..., None]
    out = (out_a.float() * w_a + out_b.float() * w_b).to(out_a.dtype)
    return out, lse
