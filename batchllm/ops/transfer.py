"""Host-to-device copies through pinned memory, without blocking: a copy from pageable memory would
wait for every step queued on the stream, which defeats asynchronous scheduling."""

from __future__ import annotations

from itertools import accumulate

import numpy as np
import torch

_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


def to_device(tensor: torch.Tensor | np.ndarray, device: torch.device) -> torch.Tensor:
    if isinstance(tensor, np.ndarray):
        tensor = torch.from_numpy(np.ascontiguousarray(tensor))
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def upload_arrays(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """int32 / int64 arrays on the device. CUDA: one copy of one pinned byte buffer holding every
    array at a 16-byte aligned offset (a copy per array costs a pinned allocation and a launch each)."""
    if device.type != "cuda":
        return {name: to_device(array, device) for name, array in arrays.items()}
    offsets = [0, *accumulate(-(-array.nbytes // 16) * 16 for array in arrays.values())]
    flat = np.empty(offsets[-1], dtype=np.uint8)
    for array, offset in zip(arrays.values(), offsets):
        flat[offset:offset + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    buffer = to_device(flat, device)
    return {name: buffer[offset:offset + array.nbytes].view(_TORCH_DTYPES[array.dtype]).view(array.shape)
            for (name, array), offset in zip(arrays.items(), offsets)}
