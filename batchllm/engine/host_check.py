"""The checks of a configuration that need the host (its GPUs, Triton), run before anything loads:
the rest of the configuration checks itself when it is built (batchllm/config.py)."""

from __future__ import annotations

import os

import torch

from batchllm.config import EngineConfig
from batchllm.engine.attention.select import resolve_backend_name
from batchllm.engine.errors import EngineConfigError
from batchllm.engine.loading import resolve_device

TRITON_BACKENDS = ("triton", "fused")


def triton_interpreter_on() -> bool:
    """Whether Triton runs its kernels in its interpreter (TRITON_INTERPRET=1), which runs them on
    the CPU, slowly: the tests use it."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_host(config: EngineConfig) -> None:
    """EngineConfigError, naming the fix, for a configuration this host cannot run."""
    if config.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise EngineConfigError(f"--device {config.device}: this machine has no CUDA GPU that PyTorch can use "
                                    "(fix: --device cpu, or auto)")
        index = int(config.device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise EngineConfigError(f"--device {config.device}: only {torch.cuda.device_count()} CUDA GPU(s) are "
                                    f"visible (fix: a device index below {torch.cuda.device_count()})")
    device = resolve_device(config.device)
    backend = resolve_backend_name(config.attention_backend, device)
    if backend in TRITON_BACKENDS and device.type != "cuda" and not triton_interpreter_on():
        raise EngineConfigError(f"--attention-backend {backend} runs Triton kernels, which need a CUDA GPU "
                                "(fix: --attention-backend torch, or auto, on the CPU)")
    if config.parallel.tensor.size > 1 and device.type == "cuda":
        if config.parallel.tensor.size > torch.cuda.device_count():
            raise EngineConfigError(f"--tensor-parallel-size {config.parallel.tensor.size} needs that many GPUs; "
                                    f"{torch.cuda.device_count()} visible (fix: at most that many)")
