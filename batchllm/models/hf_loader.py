"""Load a Hugging Face model directory: config.json + *.safetensors (sharded or not)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from batchllm.models.config import SUPPORTED_ARCHITECTURES, ModelArchConfig
from batchllm.models.refusals import SUPPORTED_ARCHITECTURES_TEXT, UnsupportedModelError, unsupported_architecture

SUPPORTED_ROPE_TYPES = ("linear", "llama3")  # besides plain RoPE (rope.py)


def hf_arch_config(model_dir: Path) -> ModelArchConfig:
    """Translate config.json (transformers v4 `rope_scaling`/`rope_theta` or v5 `rope_parameters`)."""
    raw = json.loads((model_dir / "config.json").read_text())
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise unsupported_architecture(f"{model_dir}: config.json model_type", model_type)
    if raw.get("mlp_bias"):
        raise UnsupportedModelError(f"{model_dir}: mlp_bias=True (biases in the MLP) is not supported "
                                    f"(fix: a model of a supported architecture: {SUPPORTED_ARCHITECTURES_TEXT})")
    num_heads = raw["num_attention_heads"]
    rope_theta, rope_scaling = _rope(raw)
    if rope_scaling is not None and rope_scaling.get("rope_type") not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{model_dir}: RoPE scaling {rope_scaling.get('rope_type')!r} is not supported (fix: a model with plain "
            f"RoPE or {', '.join(SUPPORTED_ROPE_TYPES)} scaling; a rope_scaling that config.json only suggests for "
            "long contexts can be removed from it)")
    generation_file = model_dir / "generation_config.json"
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else {}
    eos: list[int] = []
    for value in (raw.get("eos_token_id"), generation.get("eos_token_id")):
        eos += value if isinstance(value, list) else [] if value is None else [value]
    bos = raw.get("bos_token_id", generation.get("bos_token_id"))
    return ModelArchConfig(
        architecture=model_type,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos),
        **_sliding_window(raw, model_type),
    )


def _sliding_window(raw: dict, model_type: str) -> dict:
    """sliding_window and full_attention_layers as transformers builds its masks: Mistral slides in
    every layer; Qwen2 only with use_sliding_window, and only in layers >= max_window_layers (or
    the layers config.json's layer_types names "sliding_attention")."""
    window = raw.get("sliding_window")
    if window is None or model_type == "llama" or (model_type == "qwen2" and not raw.get("use_sliding_window")):
        return {}
    num_layers = raw["num_hidden_layers"]
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        full = [i for i, kind in enumerate(layer_types) if kind != "sliding_attention"]
    elif model_type == "qwen2":
        full = list(range(min(raw.get("max_window_layers", 28), num_layers)))
    else:
        full = []
    return {"sliding_window": int(window), "full_attention_layers": tuple(full)}


def _rope(raw: dict) -> tuple[float, dict | None]:
    parameters = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(parameters.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    if "type" in parameters and "rope_type" not in parameters:
        parameters["rope_type"] = parameters.pop("type")
    if parameters.get("rope_type", "default") == "default":
        return theta, None
    return theta, parameters


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(
            f"{model_dir}: no *.safetensors files: only safetensors checkpoints are loaded (fix: convert it with "
            "transformers: AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR) and "
            "AutoTokenizer.from_pretrained(DIR).save_pretrained(NEW_DIR))")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)

