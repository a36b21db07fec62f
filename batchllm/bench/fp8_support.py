"""Whether a device can run FP8 (e4m3 GEMMs and KV cache)."""

from __future__ import annotations

import torch

FP8_MIN_COMPUTE_CAPABILITY = (8, 9)  # Ada and Hopper have e4m3 tensor cores
FP8_REQUIREMENT = "FP8 needs an NVIDIA GPU of compute capability 8.9 or higher (Ada or Hopper)"


def fp8_unsupported_reason(device: torch.device | str) -> str | None:
    """Why FP8 cannot run on `device`, or None when it can."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"{FP8_REQUIREMENT}; this device is {device.type} (no CUDA)"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_COMPUTE_CAPABILITY:
        return f"{FP8_REQUIREMENT}; {torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}"
    return None
