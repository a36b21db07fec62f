"""Allocate a model directly on its target device in its target dtype (no CPU float32 init)."""

from __future__ import annotations

import torch

from batchllm.models.config import ModelArchConfig
from batchllm.models.llama import LlamaForCausalLM


def empty_model(config: ModelArchConfig, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """An eval-mode model whose parameters are uninitialised storage on `device` in `dtype`."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype=dtype)  # meta tensors: free
    model = model.to_empty(device=device)
    return model.eval().requires_grad_(False)
