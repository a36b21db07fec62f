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
from batchllm.models.fp8_linear import Fp8Linear, use_fp8_linears_
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

    def forward(self, x: Tensor, residual: Tensor | None = None, fused: bool = False,
                consumer: nn.Module | None = None) -> tuple[Tensor, Tensor]:
        """Returns (normed, new_residual) where new_residual = x + residual (x when None), written
        over residual: the residual stream is one tensor, updated in place by every norm (so that
        it stays in the piecewise graphs' static buffer across a piece).

        Normalise in float32, multiply by the weight in the model dtype (as HF LlamaRMSNorm);
        `fused` runs the same rounding as one Triton kernel (GPU path), which also quantizes its
        output when the layer that reads it (`consumer`) is an Fp8Linear.
        """
        if fused:
            from batchllm.ops.fused_layers import rms_norm

            fp8 = isinstance(consumer, Fp8Linear)
            return rms_norm(x, self.weight, self.eps, residual, fp8, consumer.input_scale if fp8 else None,
                            residual_out=residual)
        if residual is not None:
            x = residual.add_(x)
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

    def project_qkv(self, hidden: Tensor, rope: RopeInputs,
                    query_out: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """hidden [T, hidden_size] (or its QuantizedActivation) -> query [T, num_heads, head_dim] and
        key [T, num_kv_heads, head_dim] with RoPE applied, value [T, num_kv_heads, head_dim].
        query_out: a [T, num_heads, head_dim] tensor the query is written to (and returned)."""
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 * kv_size]
        num_tokens = qkv.shape[0]
        query, key, value = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        if rope.fused:
            from batchllm.ops.fused_layers import rope_inplace

            rope_inplace(query, key, rope.positions, rope.cos, rope.sin, query_out)  # rotates the qkv buffer
            query = query if query_out is None else query_out
        else:
            query, key = apply_rope(query, rope.cos, rope.sin), apply_rope(key, rope.cos, rope.sin)
            query = query if query_out is None else query_out.copy_(query)
        return query, key, value.view(num_tokens, self.num_kv_heads, self.head_dim)

    def project_output(self, attention_output: Tensor) -> Tensor:
        """attention_output [T, num_heads, head_dim] (or [T, q_size]) -> [T, hidden_size]."""
        return self.o_proj(attention_output.reshape(attention_output.shape[0], self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelArchConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden: Tensor, fused: bool = False) -> Tensor:
        gate_up = self.gate_up_proj(hidden)  # [T, 2 * intermediate_size]
        if fused:
            from batchllm.ops.fused_layers import silu_and_mul

            fp8 = isinstance(self.down_proj, Fp8Linear)
            return self.down_proj(silu_and_mul(gate_up, fp8, self.down_proj.input_scale if fp8 else None))
        gate, up = gate_up.chunk(2, dim=-1)  # each [T, intermediate_size]
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def pre_attention(self, hidden: Tensor, residual: Tensor | None, rope: RopeInputs,
                      query_out: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The layer up to its attention: (query, key, value, the residual stream). The residual
        stream is carried separately so each norm can fuse the add before it."""
        hidden, residual = self.input_layernorm(hidden, residual, rope.fused, self.self_attn.qkv_proj)
        return *self.self_attn.project_qkv(hidden, rope, query_out), residual

    def post_attention(self, attention_output: Tensor, residual: Tensor, fused: bool) -> tuple[Tensor, Tensor]:
        """The layer from its attention output on: (its MLP output, the residual stream before adding it)."""
        hidden = self.self_attn.project_output(attention_output)
        hidden, residual = self.post_attention_layernorm(hidden, residual, fused, self.mlp.gate_up_proj)
        return self.mlp(hidden, fused), residual


@dataclass(frozen=True)
class PieceOutput:
    """What one piece of the forward hands on (LlamaForCausalLM.piece)."""

    residual: Tensor  # [T, hidden_size] the residual stream; after the last piece, the final hidden states
    # The next layer's attention inputs (None after the last piece): query [T, num_heads, head_dim]
    # and key [T, num_kv_heads, head_dim] with RoPE applied, value [T, num_kv_heads, head_dim].
    query: Tensor | None = None
    key: Tensor | None = None
    value: Tensor | None = None


class LlamaForCausalLM(nn.Module):
    """Parameters are not meaningfully initialised here: build it through
    batchllm.models.loader.load_model (checkpoints or seeded random presets)."""

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
    def empty(cls, config: ModelArchConfig, dtype: torch.dtype, device: torch.device, *args,
              fp8: bool = False, static_input_scales: bool = False):
        """An eval-mode model whose parameters are uninitialised storage on `device` in `dtype`
        (built on "meta": no CPU float32 init); `args` follow the config to the constructor.
        fp8: the decoder's linear layers are Fp8Linear (static_input_scales: with a checkpoint's
        per-tensor activation scales)."""
        with torch.device("meta"):
            model = cls(config, *args).to(dtype=dtype)
            if fp8:
                use_fp8_linears_(model.layers, dtype, static_input_scales)
        return model.to_empty(device=device).eval().requires_grad_(False)

    @property
    def num_pieces(self) -> int:
        return len(self.layers) + 1

    def rope_inputs(self, positions: Tensor) -> RopeInputs:
        """RoPE of a step's rows (positions [T] int64), shared by every layer."""
        if self.fused_kernels:
            if self.rotary.cos is None or self.rotary.cos.device != positions.device:
                self.rotary.cos_sin(positions[:0])  # builds the table on this device once
            return RopeInputs(True, positions, self.rotary.cos, self.rotary.sin)
        return RopeInputs(False, positions, *self.rotary.cos_sin(positions))  # [T, 1, head_dim] float32

    def piece(self, index: int, input_ids: Tensor, rope: RopeInputs, attention_output: Tensor | None,
              residual: Tensor | None, query_out: Tensor | None = None) -> PieceOutput:
        """Piece `index` (0 .. num_pieces - 1) of the forward, everything between two attentions:
        piece 0 embeds input_ids [T] and runs layer 0 up to its attention; piece i runs layer i - 1
        from its attention output ([T, num_heads, head_dim] or [T, q_size]) and the residual stream
        on, then layer i up to its attention; the last piece ends the last layer and applies the
        final norm. Attention (storing the step's K/V, attending over the cache) runs between
        pieces: `forward` runs the pieces in turn, and the engine's CUDA graphs capture each piece
        for a token count (engine/piecewise_graphs.py). The residual stream is updated in place
        (RMSNorm); query_out: where the query goes (None: a new tensor)."""
        if index == 0:
            hidden, residual = self.embed_tokens(input_ids), None  # [T, hidden_size]
        else:
            hidden, residual = self.layers[index - 1].post_attention(attention_output, residual, rope.fused)
        if index == len(self.layers):
            return PieceOutput(self.norm(hidden, residual, rope.fused)[0])
        query, key, value, residual = self.layers[index].pre_attention(hidden, residual, rope, query_out)
        return PieceOutput(residual, query, key, value)

    def forward(self, input_ids: Tensor, positions: Tensor, attention: AttentionFn) -> Tensor:
        """input_ids, positions: [T] int64 -> hidden [T, hidden_size] after the final norm."""
        rope = self.rope_inputs(positions)
        # The fused RoPE writes each layer's query into one dense buffer: XQA reads its query densely
        # and would otherwise copy the strided view of the QKV rows, 0.31 ms of a 29.5 ms decode step
        # of 808 rows (Llama-3.1-8B FP8, H200).
        query = (torch.empty((input_ids.shape[0], self.config.num_heads, self.config.head_dim),
                             dtype=self.embed_tokens.weight.dtype, device=input_ids.device) if rope.fused else None)
        out = self.piece(0, input_ids, rope, None, None, query)
        for layer_index in range(len(self.layers)):
            attended = attention(layer_index, out.query, out.key, out.value)  # [T, num_heads, head_dim]
            out = self.piece(layer_index + 1, input_ids, rope, attended, out.residual, query)
        return out.residual

    def output_weight(self) -> Tensor:
        """[vocab_size, hidden_size]: lm_head, or the embedding table when tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: Tensor, float32: bool = True) -> Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size], float32 (float32=False: the model
        dtype, which the sampler widens only where it needs to)."""
        logits = F.linear(hidden, self.output_weight())
        return logits.float() if float32 else logits

    @torch.no_grad()
    def load_hf_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy HF-named tensors (model.layers.0.self_attn.q_proj.weight, ...) into the fused
        parameters, converting dtype/device. Raises if a parameter is left (partly) unfilled or
        a name is unknown.

        Fp8Linear layers take either model-precision weights (quantized here, per output channel)
        or an FP8 checkpoint's e4m3 weights with their `weight_scale` (per tensor or per output
        channel) and, for static activations, `input_scale` (the fused layer keeps the largest of
        its parts' scales, so no part's activations clip)."""
        params = dict(self.named_parameters())
        filled_rows: dict[str, int] = {name: 0 for name in params}
        for name, param in params.items():
            if name.endswith("input_scale"):
                param.data.zero_()
        for hf_name, tensor in weights:
            target = _hf_name_to_target(hf_name, self.config)
            if target is None:
                continue
            name, row_start, segment_rows = target
            kind = name.rpartition(".")[2]
            if kind == "input_scale" and name not in params:
                continue  # a checkpoint of dynamic activations may still carry calibration scales
            if name not in params:
                raise KeyError(f"checkpoint tensor {hf_name!r} maps to unknown parameter {name!r}")
            param = params[name]
            if kind == "input_scale":
                param.data.copy_(torch.maximum(param.data, tensor.reshape(()).to(param.device, param.dtype)))
                filled_rows[name] = 1
                continue
            if kind == "weight_scale":  # per tensor (one value) or per output channel
                rows = segment_rows or param.shape[0]
                tensor = tensor.reshape(-1).expand(rows) if tensor.numel() == 1 else tensor.reshape(-1)
            rows = tensor.shape[0]
            destination = param.data[row_start : row_start + rows]
            if destination.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(destination.shape)} (into {name}[{row_start}:])"
                )
            module = self.get_submodule(name.rpartition(".")[0])
            if isinstance(module, Fp8Linear) and kind == "weight" and tensor.dtype != param.dtype:
                module.load_rows_(tensor, row_start)  # model-precision rows: quantized here
                filled_rows[name.replace(".weight", ".weight_scale")] += rows
            elif tensor.dtype == torch.float8_e4m3fn and param.dtype != tensor.dtype:
                raise ValueError(f"checkpoint tensor {hf_name!r} is FP8 but {name} is {param.dtype}: "
                                 "load an FP8 checkpoint with quantization='fp8'")
            else:
                destination.copy_(tensor)
            filled_rows[name] += rows
        missing = [name for name, rows in filled_rows.items() if rows != (params[name].shape or (1,))[0]]
        if missing:
            raise ValueError(f"checkpoint leaves parameters unfilled: {missing[:8]}{' ...' if len(missing) > 8 else ''}")


_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# An FP8 checkpoint's KV-cache scales (the cache here keeps one scale per cache).
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "self_attn.k_scale", "self_attn.v_scale", "output_scale")


def _hf_name_to_target(hf_name: str, config: ModelArchConfig) -> tuple[str, int, int | None] | None:
    """HF tensor name -> (our parameter name, first row it fills, rows of its part of a fused
    layer or None for a whole parameter), or None to skip it."""
    if hf_name == "lm_head.weight" and config.tie_word_embeddings:
        return None
    if hf_name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        return hf_name.removeprefix("model."), 0, None
    match = _LAYER_NAME.match(hf_name)
    if match is None:
        raise KeyError(f"unexpected checkpoint tensor {hf_name!r}")
    layer, rest = match.groups()
    if rest.endswith(_SKIPPED_SUFFIXES):
        return None
    q_size, kv_size, intermediate = config.q_size, config.kv_size, config.intermediate_size
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, q_size),
        "self_attn.k_proj": ("self_attn.qkv_proj", q_size, kv_size),
        "self_attn.v_proj": ("self_attn.qkv_proj", q_size + kv_size, kv_size),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, intermediate),
        "mlp.up_proj": ("mlp.gate_up_proj", intermediate, intermediate),
    }
    module, _, kind = rest.rpartition(".")  # kind: "weight" | "bias" | "weight_scale" | "input_scale"
    if module in fused:
        target_module, row_start, rows = fused[module]
        return f"layers.{layer}.{target_module}.{kind}", row_start, rows
    return f"layers.{layer}.{rest}", 0, None
