"""The physical limit of a run: FLOPs of the work / measured bf16 matmul peak (docs/design.md).

Thin wrapper: the code lives in batchllm/bench/flop_bound.py."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from batchllm.bench.flop_bound import (  # noqa: E402,F401
    H200_BF16_PEAK_FLOPS,
    attention_flops,
    flop_bound_seconds,
    workload_flops,
)
