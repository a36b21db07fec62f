"""Dense attention with its log-sum-exp: the block of KV that every row of a segment sees whole
(attention_plan.dense_calls.cut_dense_calls), rows x KV positions with no mask, or a prefill
chunk's causal square over its own positions, on a library kernel.

On float16 / bfloat16 CUDA tensors this is cuDNN's fused attention through PyTorch's SDPA op
that also returns the log-sum-exp, with grouped-query heads as they are (no repeated KV);
elsewhere (the CPU tests, float32) a float32 reference.
"""

from __future__ import annotations

import torch

CUDNN_DTYPES = (torch.float16, torch.bfloat16)
CUDNN_HEAD_DIMS = (64, 128)


def uses_cudnn(query: torch.Tensor, key: torch.Tensor) -> bool:
    return (query.is_cuda and query.dtype in CUDNN_DTYPES and key.dtype == query.dtype
            and query.shape[-1] in CUDNN_HEAD_DIMS and torch.backends.cudnn.is_available())


def dense_attention_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        scale: float, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """query [L, H, D], key / value [S, KVH, D] (H a multiple of KVH; only the last dim need be
    contiguous), or all three with a leading batch dim [B, ...] -> (out [..., L, H, D] in the
    query dtype (float32 off cuDNN), lse [..., L, H] float32, natural log of each row's softmax
    denominator). causal: L == S, row i sees keys 0..i."""
    batched = query.dim() == 4
    if not batched:
        query, key, value = (t.unsqueeze(0) for t in (query, key, value))
    batch, num_rows, num_heads = query.shape[:3]
    num_kv_heads = key.shape[2]
    if causal and num_rows != key.shape[1]:
        raise ValueError(f"a causal dense call needs as many rows as keys, got {num_rows} / {key.shape[1]}")
    if uses_cudnn(query, key):
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, heads, tokens, D] views
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
        out, lse = out.transpose(1, 2), lse.reshape(batch, num_heads, num_rows).transpose(1, 2)
    else:
        group = num_heads // num_kv_heads
        k = key.float().repeat_interleave(group, dim=2)
        v = value.float().repeat_interleave(group, dim=2)
        scores = torch.einsum("blhd,bshd->bhls", query.float(), k) * scale
        if causal:
            scores = scores.masked_fill(torch.ones_like(scores[0, 0], dtype=torch.bool).triu(1), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [B, H, L]
        out = torch.einsum("bhls,bshd->blhd", torch.exp(scores - lse[..., None]), v)
        lse = lse.transpose(1, 2)
    return (out, lse) if batched else (out[0], lse[0])
