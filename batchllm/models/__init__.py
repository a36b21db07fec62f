"""Model code (Llama-family decoder on a flat token batch) and weight loaders."""

from batchllm.models.loader import load_model

__all__ = ["load_model"]
