"""Configuration of tensor parallelism (one process per GPU on one host)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorParallelConfig:
    tensor_parallel_size: int = 1  # processes (GPUs) the model is split across
    backend: str = "auto"  # auto: nccl on CUDA, gloo on CPU
    master_port: int | None = None  # TCP rendezvous port on 127.0.0.1; None: a free one
    timeout_s: float = 600.0  # a collective waiting longer than this raises (a dead worker)

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"backend must be auto, nccl or gloo, got {self.backend!r}")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")

    def resolve_backend(self, device_type: str) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if device_type == "cuda" else "gloo"
