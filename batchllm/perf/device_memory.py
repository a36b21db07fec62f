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


# The caching allocator's counters a bench row reports (torch.cuda.memory_stats): a retry follows
# a failed cudaMalloc and first frees the cache, and every cudaFree waits for the device, so a run
# that counts retries or frees had launches that waited for the GPU.
ALLOCATOR_COUNTERS = {"num_alloc_retries": "allocator_retries", "num_device_alloc": "device_mallocs",
                      "num_device_free": "device_frees"}


def allocator_counts(device) -> dict[str, int]:
    """The allocator's counters on a CUDA device, by row field; empty on any other device."""
    import torch

    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {field: int(stats.get(name, 0)) for name, field in ALLOCATOR_COUNTERS.items()}


def allocator_counts_since(device, before: dict[str, int]) -> dict[str, int]:
    """What the counters of allocator_counts added since it returned `before`."""
    return {field: count - before.get(field, 0) for field, count in allocator_counts(device).items()}
