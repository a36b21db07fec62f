"""Which FP8 layout a Hugging Face checkpoint uses, from the quantization section of config.json.

The public FP8 Llama-3.1 releases store the linear layers' weights in float8_e4m3fn with a
`weight_scale` (one per tensor or one per output channel) and, when activations are static, an
`input_scale` per tensor. Three `quant_method`s describe them:
  "fp8"                {"activation_scheme": "static" | "dynamic"}
  "fbgemm_fp8"         per-channel weights, dynamic per-token activations
  "compressed-tensors" {"config_groups": {...: {"weights": {"type": "float", "num_bits": 8,
                        "strategy": "tensor" | "channel"}, "input_activations": {"dynamic": bool} | null}}}
Embedding, LM head and norms stay in bf16 in all of them (the LM head is in their ignore lists).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from batchllm.models.refusals import SUPPORTED_CHECKPOINTS_TEXT, UnsupportedModelError, unsupported_quantization


@dataclass(frozen=True)
class Fp8CheckpointFormat:
    quant_method: str
    static_input_scales: bool  # True: activations use the checkpoint's per-tensor input_scale


def fp8_checkpoint_format(model_dir: Path) -> Fp8CheckpointFormat | None:
    """The FP8 layout of a HF model directory, None for an unquantized checkpoint; a clear error
    for a quantization this engine does not load."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    section = raw.get("quantization_config")
    if not section:
        return None
    method = section.get("quant_method")
    if method == "fp8":
        if section.get("weight_block_size"):
            raise UnsupportedModelError(
                f"{model_dir}: block-wise FP8 weights (weight_block_size) are not supported (fix: a per-tensor or "
                f"per-channel FP8 checkpoint, or the model's bf16 release with --quantization fp8)")
        return Fp8CheckpointFormat(method, section.get("activation_scheme", "dynamic") == "static")
    if method == "fbgemm_fp8":
        return Fp8CheckpointFormat(method, False)
    if method == "compressed-tensors":
        return Fp8CheckpointFormat(method, _compressed_tensors_static(model_dir, section))
    raise unsupported_quantization(str(model_dir), f"config.json quant_method {method!r}")


def _compressed_tensors_static(model_dir: Path, section: dict) -> bool:
    groups = list((section.get("config_groups") or {}).values())
    if not groups:
        raise UnsupportedModelError(f"{model_dir}: a compressed-tensors config without config_groups is not "
                                    f"supported (fix: use {SUPPORTED_CHECKPOINTS_TEXT})")
    static = set()
    for group in groups:
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8 or \
                weights.get("strategy") not in ("tensor", "channel"):
            raise unsupported_quantization(
                str(model_dir), f"its compressed-tensors weights ({weights.get('type')}, "
                f"{weights.get('num_bits')} bits, strategy {weights.get('strategy')}; 8-bit float weights per "
                "tensor or per channel are loaded)")
        activations = group.get("input_activations")
        static.add(bool(activations) and not activations.get("dynamic", True))
    if len(static) > 1:
        raise UnsupportedModelError(f"{model_dir}: mixed static and dynamic activation groups are not supported "
                                    f"(fix: use {SUPPORTED_CHECKPOINTS_TEXT})")
    return static.pop()
