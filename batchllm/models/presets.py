"""Random-weight presets with real architectures' shapes (throughput work without downloads).

Spec syntax: ``random:<name>`` or ``random:<name>?key=value&key=value``, where a key is a
ModelArchConfig field (e.g. ``num_layers=2``, ``vocab_size=1000``, ``tie_word_embeddings=true``)
or ``seed`` (default 0). Example: ``random:llama-3.1-8b?num_layers=2``.
Weights ~ N(0, 0.02), biases ~ N(0, 0.02), norm weights 1; drawn on the target device.
"""

from __future__ import annotations

import dataclasses
import types
import typing

import torch

from batchllm.models.default_model import RANDOM_PREFIX
from batchllm.models.config import ModelArchConfig
from batchllm.models.llama import LlamaForCausalLM
from batchllm.ops.fp8 import FP8_DTYPE

# Shapes from the public config.json / generation_config.json of the Instruct checkpoints.
_LLAMA_31_8B = ModelArchConfig(
    architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    max_position_embeddings=131072, tie_word_embeddings=False, qkv_bias=False,
    bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
)
_QWEN_25_7B = ModelArchConfig(
    architecture="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
    num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
    rope_scaling=None, max_position_embeddings=32768, tie_word_embeddings=False, qkv_bias=True,
    bos_token_id=151643, eos_token_ids=(151645, 151643),
)
PRESETS: dict[str, ModelArchConfig] = {
    "llama-3.1-8b": _LLAMA_31_8B,
    "llama-3.1-70b": dataclasses.replace(
        _LLAMA_31_8B, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64
    ),
    "qwen2.5-7b": _QWEN_25_7B,
    "qwen2.5-14b": dataclasses.replace(
        _QWEN_25_7B, hidden_size=5120, intermediate_size=13824, num_layers=48, num_heads=40, num_kv_heads=8
    ),
    "tiny": ModelArchConfig(
        architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=2048,
        tie_word_embeddings=True, qkv_bias=False, bos_token_id=1, eos_token_ids=(2,),
    ),
}

WEIGHT_STD = 0.02


@dataclasses.dataclass(frozen=True)
class RandomSpec:
    config: ModelArchConfig  # with overrides applied
    seed: int


def parse_random_spec(spec: str) -> RandomSpec:
    """'random:llama-3.1-8b?num_layers=2&seed=1' -> RandomSpec."""
    if not spec.startswith(RANDOM_PREFIX):
        raise ValueError(f"not a random preset spec: {spec!r}")
    name, _, query = spec[len(RANDOM_PREFIX) :].partition("?")
    if name not in PRESETS:
        raise ValueError(f"unknown random preset {name!r} (fix: one of "
                         f"{', '.join(RANDOM_PREFIX + known for known in sorted(PRESETS))})")
    seed = 0
    overrides: dict[str, object] = {}
    field_types = typing.get_type_hints(ModelArchConfig)
    for item in filter(None, query.split("&")):
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"bad override {item!r} in {spec!r}: expected key=value")
        if key == "seed":
            seed = int(raw)
        elif key in field_types:
            overrides[key] = _parse_value(key, raw, field_types[key])
        else:
            raise ValueError(f"unknown override {key!r} in {spec!r}; use a ModelArchConfig field or seed")
    return RandomSpec(config=dataclasses.replace(PRESETS[name], **overrides), seed=seed)


def _parse_value(key: str, raw: str, annotation: object) -> object:
    options = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    if raw.lower() in ("none", "null") and type(None) in options:
        return None
    if bool in options:
        if raw.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"override {key}={raw!r}: expected true/false")
        return raw.lower() in ("true", "1")
    for kind in (int, float, str):
        if kind in options:
            return kind(raw)
    raise ValueError(f"override {key} cannot be set from the spec string")


def fill_random_(name: str, param: torch.Tensor, generator: torch.Generator) -> None:
    """Draw one parameter as the presets do: norm weights 1, the rest N(0, WEIGHT_STD)."""
    if name.endswith("norm.weight"):
        param.fill_(1.0)
    else:
        param.normal_(0.0, WEIGHT_STD, generator=generator)


@torch.no_grad()
def random_model(spec: RandomSpec, dtype: torch.dtype, device: torch.device, fp8: bool = False) -> LlamaForCausalLM:
    """Allocate on `device` in `dtype` and draw weights there with a seeded generator. fp8: the
    linear layers hold the e4m3 quantization of the same draws (one layer's weight at a time in
    `dtype`, so a model too large for the GPU in bf16 still loads)."""
    model = LlamaForCausalLM.empty(spec.config, dtype, device, fp8=fp8)
    generator = torch.Generator(device=device).manual_seed(spec.seed)
    for name, param in model.named_parameters():
        if param.dtype == FP8_DTYPE:  # an Fp8Linear's weight: draw in dtype, then quantize
            draw = torch.empty(param.shape, dtype=dtype, device=device)
            fill_random_(name, draw, generator)
            model.get_submodule(name.removesuffix(".weight")).load_rows_(draw, 0)
            del draw
        elif not name.endswith("weight_scale"):  # filled with its weight
            fill_random_(name, param, generator)
    return model
