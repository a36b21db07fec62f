"""Tensor-parallel layers (Megatron-LM style) and the sharded Llama model (docs/scale-out.md).

A shard is LlamaForCausalLM built from the shard's architecture, so the column-parallel layers
(qkv_proj, gate_up_proj) are plain nn.Linear of the shard's width and parameter names are
unchanged; o_proj / down_proj, embed_tokens and compute_logits differ.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from batchllm.models.config import ModelArchConfig
from batchllm.models.llama import LlamaForCausalLM


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_shard @ W[:, shard].T): input features split across ranks (no bias)."""

    def __init__(self, in_features_per_rank: int, out_features: int, group) -> None:
        super().__init__(in_features_per_rank, out_features, bias=False)
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        out = F.linear(x, self.weight)  # [T, out_features], a partial sum
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab_start, vocab_start + num_embeddings) of the table; other ids give zeros,
    and the all-reduce sums the one rank that holds each id."""

    def __init__(self, num_embeddings_per_rank: int, embedding_dim: int, vocab_start: int, group) -> None:
        super().__init__(num_embeddings_per_rank, embedding_dim, _weight=torch.empty(num_embeddings_per_rank, embedding_dim))
        self.vocab_start = vocab_start
        self.group = group

    def forward(self, input_ids: Tensor) -> Tensor:
        local = input_ids - self.vocab_start  # [T]
        outside = (local < 0) | (local >= self.num_embeddings)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        hidden = hidden.masked_fill(outside[:, None], 0)
        dist.all_reduce(hidden, group=self.group)
        return hidden


class TensorParallelLlama(LlamaForCausalLM):
    """One rank's shard. forward is LlamaForCausalLM's; compute_logits gathers the vocabulary."""

    def __init__(self, shard_config: ModelArchConfig, full_vocab_size: int, rank: int, world_size: int,
                 group) -> None:
        super().__init__(shard_config)
        self.full_vocab_size = full_vocab_size
        self.rank, self.world_size, self.group = rank, world_size, group
        vocab_per_rank = shard_config.vocab_size
        self.embed_tokens = VocabParallelEmbedding(vocab_per_rank, shard_config.hidden_size,
                                                   rank * vocab_per_rank, group)
        for layer in self.layers:
            layer.self_attn.o_proj = RowParallelLinear(shard_config.q_size, shard_config.hidden_size, group)
            layer.mlp.down_proj = RowParallelLinear(shard_config.intermediate_size, shard_config.hidden_size, group)

    def compute_logits(self, hidden: Tensor, float32: bool = True) -> Tensor:
        """hidden [N, hidden_size] -> logits [N, full_vocab_size] on every rank, float32 (float32=False:
        the model dtype)."""
        local = F.linear(hidden, self.output_weight())  # [N, vocab_per_rank], model dtype
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        # Rounding to float32 after the gather gives the unsharded model's values exactly.
        logits = torch.cat(parts, dim=-1)[:, : self.full_vocab_size]
        return logits.float() if float32 else logits
