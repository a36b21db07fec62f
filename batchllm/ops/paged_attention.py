"""Plain paged attention for mixed prefill/decode batches, without prefix sharing.

What the vllm/sglang baseline policies run. It is the same Triton kernel as the fused one
(split-KV for long decode contexts, GQA heads packed into the tile, causal clipping of
prefill chunks, cost-sorted work), fed a work list that knows nothing about groups: each
request reads its whole KV [0, seq_len) itself.
"""

from __future__ import annotations

import torch

from batchllm.ops.prefix_attention import prefix_shared_attention
from batchllm.ops.validation import check
from batchllm.ops.work_list import PrefixSharedPlanOnDevice, build_prefix_shared_plan, device_num_sms


def build_paged_plan(query_start_loc, seq_lens, shared_kv_lens, block_tables, *, block_size: int,
                     num_kv_heads: int, num_heads: int, head_dim: int = 128, **kwargs):
    """Work list of a batch without sharing knowledge (host numpy); `.to(device)` it."""
    return build_prefix_shared_plan(query_start_loc, seq_lens, shared_kv_lens, block_tables, None, None,
                                    block_size=block_size, num_kv_heads=num_kv_heads, num_heads=num_heads,
                                    head_dim=head_dim, **kwargs)


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

    Pass a prebuilt `plan` (build_paged_plan(...).to(device), once per step) to avoid the
    metadata copy to the host on every layer.
    """
    if plan is None:
        check(query.dim() == 3 and k_cache.dim() == 4, "query must be [T, H, D] and k_cache [N, B, Hkv, D]")
        plan = build_paged_plan(query_start_loc, seq_lens, shared_kv_lens, block_tables,
                                block_size=k_cache.shape[1], num_kv_heads=k_cache.shape[2],
                                num_heads=query.shape[1], head_dim=query.shape[2],
                                num_sms=device_num_sms(query.device)).to(query.device)
    positions = None
    if sliding_window is not None:  # row i of seq s sits at seq_len - q_len + i
        q_lens = query_start_loc[1:] - query_start_loc[:-1]
        first = (seq_lens - q_lens).long().repeat_interleave(q_lens.long(), output_size=query.shape[0])
        seq_start = query_start_loc[:-1].long().repeat_interleave(q_lens.long(), output_size=query.shape[0])
        positions = first + torch.arange(query.shape[0], device=query.device) - seq_start
    return prefix_shared_attention(query, k_cache, v_cache, plan, scale, sliding_window, positions)
