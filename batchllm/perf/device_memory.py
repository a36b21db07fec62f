"""Freeing device memory between the engines and peers that one bench process runs in turn."""

from __future__ import annotations

import gc


def free_device_memory() -> None:
    """Collect dropped engines and hand their cached GPU memory back, so the next engine sizes its
    KV cache from all of it (and the HF peer runs with none of it held)."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
