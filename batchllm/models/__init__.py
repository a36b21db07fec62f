"""Model code (Llama-family decoder on a flat token batch) and weight loaders."""

from batchllm.models.config import ModelArchConfig
from batchllm.models.llama import AttentionFn, LlamaForCausalLM
from batchllm.models.loader import LoadedModel, load_model

__all__ = ["AttentionFn", "LlamaForCausalLM", "LoadedModel", "ModelArchConfig", "load_model"]
