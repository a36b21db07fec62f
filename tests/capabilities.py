"""What this machine's torch can do, for tests that need it (torch-only, no batchllm imports)."""

from __future__ import annotations

import functools

import pytest
import torch


@functools.cache
def cpu_rowwise_scaled_mm() -> bool:
    """Whether torch._scaled_mm takes row-wise scales on the CPU (torch 2.13 does; 2.11 takes
    per-tensor scales only there)."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


needs_cpu_fp8_gemm = pytest.mark.skipif(
    not cpu_rowwise_scaled_mm(),
    reason="this torch's CPU _scaled_mm takes per-tensor scales only: the CPU FP8 layer math needs torch >= 2.13 "
           "(the GPU tests check the FP8 layers on CUDA)")
