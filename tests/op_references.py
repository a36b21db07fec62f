"""Ops that only the tests and benchmarks use: PyTorch oracles (dense and prefix-shared attention,
the LSE merge, the element-wise layers of the fused kernels) and `paged_attention`, plain paged
attention in one call. The engine's own references (its CPU path) stay in batchllm/ops/reference.py.

    from op_references import paged_attention, prefix_shared_attention_reference
"""

from __future__ import annotations

import torch

from batchllm.attention_plan.checks import check
from batchllm.attention_plan.work_list import build_prefix_shared_plan as build_paged_plan
from batchllm.ops.plan_device import PrefixSharedPlanOnDevice, device_num_sms, plan_to_device
from batchllm.ops.prefix_attention import prefix_shared_attention
from batchllm.ops.reference import kv_slots_of_seq, visible_kv


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


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    rows_per_chunk: int = 1024) -> torch.Tensor:
    """float32 causal attention, bottom-right aligned, computed in row chunks. q [B, H, Lq, D],
    k / v [B, H, L, D]; returns [B * Lq, H, D] (the packed layout of our kernel)."""
    q_len, context = q.shape[2], k.shape[2]
    kf, vf = k.float(), v.float()
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for r0 in range(0, q_len, rows_per_chunk):
        r1 = min(q_len, r0 + rows_per_chunk)
        scores = q[:, :, r0:r1].float() @ kf.transpose(-1, -2) * scale  # [B, H, rows, L]
        visible = torch.arange(context, device=q.device)[None, :] <= (
            context - q_len + torch.arange(r0, r1, device=q.device)[:, None])
        scores.masked_fill_(~visible, float("-inf"))
        out[:, :, r0:r1] = torch.softmax(scores, dim=-1) @ vf
    return out.transpose(1, 2).reshape(-1, q.shape[1], q.shape[3])

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


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    shared_kv_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    scale: float,
    *,
    plan: PrefixSharedPlanOnDevice | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal paged attention of every row over its seq's KV; out [num_tokens, num_heads, head_dim].
    With a sliding window W, a row at position p sees KV positions in (p - W, p] only.

    Pass a prebuilt `plan` (plan_to_device(build_paged_plan(...), device), once per step) to avoid the
    metadata copy to the host on every layer.
    """
    if plan is None:
        check(query.dim() == 3 and k_cache.dim() == 4, "query must be [T, H, D] and k_cache [N, B, Hkv, D]")
        host_plan = build_paged_plan(query_start_loc, seq_lens, shared_kv_lens, block_tables,
                                     block_size=k_cache.shape[1], num_kv_heads=k_cache.shape[2],
                                     num_heads=query.shape[1], head_dim=query.shape[2],
                                     num_sms=device_num_sms(query.device))
        plan = plan_to_device(host_plan, query.device)
    positions = None
    if sliding_window is not None:  # row i of seq s sits at seq_len - q_len + i
        q_lens = query_start_loc[1:] - query_start_loc[:-1]
        first = (seq_lens - q_lens).long().repeat_interleave(q_lens.long(), output_size=query.shape[0])
        seq_start = query_start_loc[:-1].long().repeat_interleave(q_lens.long(), output_size=query.shape[0])
        positions = first + torch.arange(query.shape[0], device=query.device) - seq_start
    return prefix_shared_attention(query, k_cache, v_cache, plan, scale, sliding_window, positions)


class RaggedFp8PrefillReference:
    """FA3's FP8 ragged prefill (a planned BatchPrefillWithRaggedKVCacheWrapper, ops/fa3_dense.py)
    in float32: entry i's rows attend its KV, causal entries under the bottom-right mask (row r of
    n sees the first kv_len - n + r + 1 positions); the query and cache values dequantized by their
    scales (the query's per head, the softmax scale folded in); returns (out in out_dtype, base-2
    log-sum-exp [rows, heads] float32), as the wrapper's run(..., return_lse=True) does."""

    def __init__(self, qo_lens, kv_lens, causal: bool, out_dtype: torch.dtype) -> None:
        self.qo_lens, self.kv_lens, self.causal, self.out_dtype = list(qo_lens), list(kv_lens), causal, out_dtype

    def run(self, q8, k8, v8, q_scale, k_scale, v_scale, return_lse=True):
        q = q8.float() * q_scale.float()[None, :, None]
        k, v = k8.float() * k_scale, v8.float() * v_scale
        group = q.shape[1] // k.shape[1]
        outs, lses, row, pos = [], [], 0, 0
        for num_rows, kv_len in zip(self.qo_lens, self.kv_lens):
            keys = k[pos:pos + kv_len].repeat_interleave(group, dim=1)
            values = v[pos:pos + kv_len].repeat_interleave(group, dim=1)
            scores = torch.einsum("lhd,shd->hls", q[row:row + num_rows], keys)
            if self.causal:
                limit = kv_len - num_rows + torch.arange(num_rows, device=q.device)
                hidden = torch.arange(kv_len, device=q.device)[None, :] > limit[:, None]
                scores = scores.masked_fill(hidden[None], float("-inf"))
            lse = torch.logsumexp(scores, dim=-1)
            outs.append(torch.einsum("hls,shd->lhd", torch.exp(scores - lse[..., None]), values))
            lses.append(lse.transpose(0, 1) * 1.4426950408889634)
            row, pos = row + num_rows, pos + kv_len
        return torch.cat(outs).to(self.out_dtype), torch.cat(lses)
