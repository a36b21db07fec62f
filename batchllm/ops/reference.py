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
seq_len - q_len + i and attends KV positions <= its own (causal); with a sliding window W, only
positions > its own - W (HF transformers' sliding-window mask: the last W positions, itself included).
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
    sliding_window: int | None = None,
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
        mask = visible_kv(torch.arange(kv_len, device=query.device), q_pos, sliding_window)
        scores = scores.masked_fill(~mask, float("-inf"))
        seq_lse = torch.logsumexp(scores, dim=-1)  # [num_heads, q_len]
        probs = torch.exp(scores - seq_lse[..., None])
        out[q_begin:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
        lse[q_begin:q_end] = seq_lse.transpose(0, 1)
    if return_lse:
        return out, lse
    return out


def visible_kv(kv_positions: torch.Tensor, q_positions: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """[q, kv] bool: which KV positions each query position attends (causal, and within the window)."""
    visible = kv_positions[None, :] <= q_positions[:, None]
    if sliding_window is not None:
        visible &= kv_positions[None, :] > q_positions[:, None] - sliding_window
    return visible


def dense_causal_attention(
    query: torch.Tensor,  # [q_len, num_heads, d]
    key: torch.Tensor,  # [kv_len, num_kv_heads, d]
    value: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Contiguous causal attention (the last q_len of kv_len positions): an oracle for the paged one."""
    group_size = query.shape[1] // key.shape[1]
    k = key.float().repeat_interleave(group_size, dim=1)
    v = value.float().repeat_interleave(group_size, dim=1)
    q_len, kv_len = query.shape[0], key.shape[0]
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale
    mask = visible_kv(torch.arange(kv_len), torch.arange(kv_len - q_len, kv_len), sliding_window)
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


def prefix_shared_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    seq_lens: torch.Tensor,  # [num_seqs]
    shared_kv_lens: torch.Tensor,  # [num_seqs]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    group_ids: torch.Tensor,  # [num_seqs] int, -1 = no group (groups are contiguous)
    is_prefix: torch.Tensor,  # [num_seqs] bool: the seq is its group's common-prefix chunk
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Prefix-shared attention as two parts merged by log-sum-exp (BatchLLM section 5), float32 math.

    Group g's prefix length P_g = max over its seqs of (seq_len if is_prefix else shared_kv_len),
    stored in the first ceil(P_g / B) blocks of any member's table. A grouped row at position
    pos sees prefix positions [0, min(P_g, pos + 1 if is_prefix else shared_kv_len)) there,
    plus its own KV [shared_kv_len, pos] (none for a prefix seq). Ungrouped seqs: plain paged.
    Equals paged_attention_reference when the block tables honour the addressing rule.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group_size = num_heads // num_kv_heads
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    shared, groups, prefix = shared_kv_lens.tolist(), group_ids.tolist(), is_prefix.tolist()
    prefix_len: dict[int, int] = {}
    rep_seq: dict[int, int] = {}
    for s, g in enumerate(groups):
        if g >= 0:
            prefix_len[g] = max(prefix_len.get(g, 0), lens[s] if prefix[s] else shared[s])
            rep_seq.setdefault(g, s)
    out = torch.empty_like(query)

    def part(q, slots, positions, q_pos, visible_end):
        # q: [q_len, H, d]; slots/positions: [kv]; visible: positions < visible_end[row], <= q_pos[row]
        k = flat_k[slots].float().repeat_interleave(group_size, dim=1)
        v = flat_v[slots].float().repeat_interleave(group_size, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        mask = visible_kv(positions, q_pos, sliding_window) & (positions[None, :] < visible_end[:, None])
        scores = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [H, q_len]
        probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
        return torch.einsum("hqk,khd->qhd", probs, v), lse.transpose(0, 1)

    device = query.device
    for s in range(len(lens)):
        q_begin, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_begin
        if q_len == 0:
            continue
        q = query[q_begin:q_end].float()
        q_pos = torch.arange(lens[s] - q_len, lens[s], device=device)
        outs, lses = [], []
        g = groups[s]
        own_start = shared[s] if g >= 0 else 0
        if g >= 0 and prefix_len[g] > 0:
            p_len = prefix_len[g]
            positions = torch.arange(p_len, device=device)
            slots = kv_slots_of_seq(block_tables[rep_seq[g]], p_len, 0, block_size)
            end = q_pos + 1 if prefix[s] else torch.full_like(q_pos, shared[s])
            o, lse = part(q, slots, positions, q_pos, end.clamp(max=p_len))
            outs.append(o)
            lses.append(lse)
        if not (g >= 0 and prefix[s]) and lens[s] > own_start:
            slots = kv_slots_of_seq(block_tables[s], lens[s], shared[s], block_size)[own_start:]
            positions = torch.arange(own_start, lens[s], device=device)
            o, lse = part(q, slots, positions, q_pos, torch.full_like(q_pos, lens[s]))
            outs.append(o)
            lses.append(lse)
        merged, merged_lse = outs[0], lses[0]
        for o, lse in zip(outs[1:], lses[1:]):
            merged, merged_lse = merge_attention_states_reference(merged, merged_lse, o, lse)
        out[q_begin:q_end] = merged.to(query.dtype)
    return out


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """(normed, new_residual) with the rounding of HF's LlamaRMSNorm after `x + residual`."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, x


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rope_reference(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [max_positions, D] float32 -> rotate-half RoPE in float32, cast back."""
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    x32 = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * c + rotated * s).to(x.dtype)
