"""Llama-family decoder (Llama, Llama-3 rope scaling, Qwen2 qkv bias, Mistral) on a flat token batch.

No padding and no batch dimension: every tensor has the step's tokens as its first axis, and the
caller's AttentionFn knows which rows belong to which sequence (the paged-KV metadata lives there,
not in the model). QKV and gate/up projections are fused: one matmul each.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Iterable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchllm.models.config import ModelArchConfig
from batchllm.models.rope import RotaryEmbedding, apply_rope


class AttentionFn(Protocol):
    def __call__(self, layer_index: int, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """query [T, num_heads, head_dim] (rope applied), key/value [T, num_kv_heads, head_dim]
        -> [T, num_heads, head_dim]."""
        ...


@dataclass(frozen=True)
class RopeInputs:
    """RoPE for one step, computed once and shared by every layer."""

    fused: bool  # True: cos/sin are the whole [max_positions, head_dim] tables (Triton kernel)
    positions: Tensor  # [T] int64
    cos: Tensor  # fused: [max_positions, head_dim]; else gathered [T, 1, head_dim], float32
    sin: Tensor


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor, residual: Tensor | None = None, fused: bool = False) -> tuple[Tensor, Tensor]:
        """Returns (normed, new_residual) where new_residual = x + residual (x when None).

        Normalise in float32, multiply by the weight in the model dtype (as HF LlamaRMSNorm);
        `fused` runs the same rounding as one Triton kernel (GPU path).
        """
        if fused:
            from batchllm.ops.fused_layers import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype), x


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelArchConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(self, layer_index: int, hidden: Tensor, rope: RopeInputs, attention: AttentionFn) -> Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 * kv_size]
        query, key, value = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        if rope.fused:
            from batchllm.ops.fused_layers import rope_inplace

            rope_inplace(query, key, rope.positions, rope.cos, rope.sin)  # rotates the qkv buffer
        else:
            query, key = apply_rope(query, rope.cos, rope.sin), apply_rope(key, rope.cos, rope.sin)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        output = attention(layer_index, query, key, value)  # [T, num_heads, head_dim]
        return self.o_proj(output.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelArchConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden: Tensor, fused: bool = False) -> Tensor:
        gate_up = self.gate_up_proj(hidden)  # [T, 2 * intermediate_size]
        if fused:
            from batchllm.ops.fused_layers import silu_and_mul

            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)  # each [T, intermediate_size]
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self, layer_index: int, hidden: Tensor, residual: Tensor | None, rope: RopeInputs, attention: AttentionFn
    ) -> tuple[Tensor, Tensor]:
        """The residual stream is carried separately so each norm can fuse the add before it:
        returns (this layer's MLP output, the residual stream before adding it)."""
        hidden, residual = self.input_layernorm(hidden, residual, rope.fused)
        hidden = self.self_attn(layer_index, hidden, rope, attention)
        hidden, residual = self.post_attention_layernorm(hidden, residual, rope.fused)
        return self.mlp(hidden, rope.fused), residual


class LlamaForCausalLM(nn.Module):
    """Parameters are not meaningfully initialised here: build it through
    batchllm.models.load_model (checkpoints or seeded random presets)."""

    def __init__(self, config: ModelArchConfig):
        super().__init__()
        self.config = config
        # _weight skips nn.Embedding's normal_ init, whose first call on "meta" costs a ~1 s
        # import; loaders and presets fill every parameter anyway.
        embedding = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=embedding)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Tied: no lm_head module, compute_logits reads embed_tokens.weight (no tie to lose on
        # meta -> device materialisation).
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)
        # Fused Triton kernels for norm / RoPE / SwiGLU (the engine turns them on for CUDA).
        self.fused_kernels = False

    @classmethod
    def empty(cls, config: ModelArchConfig, dtype: torch.dtype, device: torch.device, *args):
        """An eval-mode model whose parameters are uninitialised storage on `device` in `dtype`
        (built on "meta": no CPU float32 init); `args` follow the config to the constructor."""
        with torch.device("meta"):
            model = cls(config, *args)
        return model.to(dtype=dtype).to_empty(device=device).eval().requires_grad_(False)

    def forward(self, input_ids: Tensor, positions: Tensor, attention: AttentionFn) -> Tensor:
        """input_ids, positions: [T] int64 -> hidden [T, hidden_size] after the final norm."""
        if self.fused_kernels:
            self.rotary.cos_sin(positions[:0])  # builds the table on this device once
            rope = RopeInputs(True, positions, self.rotary.cos, self.rotary.sin)
        else:
            rope = RopeInputs(False, positions, *self.rotary.cos_sin(positions))  # [T, 1, head_dim] float32
        hidden = self.embed_tokens(input_ids)  # [T, hidden_size]
        residual = None
        for layer_index, layer in enumerate(self.layers):
            hidden, residual = layer(layer_index, hidden, residual, rope, attention)
        return self.norm(hidden, residual, self.fused_kernels)[0]

    def output_weight(self) -> Tensor:
        """[vocab_size, hidden_size]: lm_head, or the embedding table when tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] float32."""
        return F.linear(hidden, self.output_weight()).float()

    @torch.no_grad()
    def load_hf_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy HF-named tensors (model.layers.0.self_attn.q_proj.weight, ...) into the fused
        parameters, converting dtype/device. Raises if a parameter is left (partly) unfilled or
        a name is unknown."""
        params = dict(self.named_parameters())
        filled_rows: dict[str, int] = {name: 0 for name in params}
        for hf_name, tensor in weights:
            target = _hf_name_to_target(hf_name, self.config)
            if target is None:
                continue
            name, row_start = target
            if name not in params:
                raise KeyError(f"checkpoint tensor {hf_name!r} maps to unknown parameter {name!r}")
            rows = tensor.shape[0]
            destination = params[name].data[row_start : row_start + rows]
            if destination.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(destination.shape)} (into {name}[{row_start}:])"
                )
            destination.copy_(tensor)
            filled_rows[name] += rows
        missing = [name for name, rows in filled_rows.items() if rows != params[name].shape[0]]
        if missing:
            raise ValueError(f"checkpoint leaves parameters unfilled: {missing[:8]}{' ...' if len(missing) > 8 else ''}")


_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _hf_name_to_target(hf_name: str, config: ModelArchConfig) -> tuple[str, int] | None:
    """HF tensor name -> (our parameter name, first row it fills), or None to skip it."""
    if hf_name == "lm_head.weight" and config.tie_word_embeddings:
        return None
    if hf_name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        return hf_name.removeprefix("model."), 0
    match = _LAYER_NAME.match(hf_name)
    if match is None:
        raise KeyError(f"unexpected checkpoint tensor {hf_name!r}")
    layer, rest = match.groups()
    if rest.endswith("rotary_emb.inv_freq"):
        return None
    q_size, kv_size = config.q_size, config.kv_size
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", q_size),
        "self_attn.v_proj": ("self_attn.qkv_proj", q_size + kv_size),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", config.intermediate_size),
    }
    module, _, kind = rest.rpartition(".")  # kind: "weight" | "bias"
    if module in fused:
        target_module, row_start = fused[module]
        return f"layers.{layer}.{target_module}.{kind}", row_start
    return f"layers.{layer}.{rest}", 0
