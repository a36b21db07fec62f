"""The engine every front door builds (LLM(...), `batchllm run`): one device, or tensor parallel."""

from __future__ import annotations

from batchllm.config import EngineConfig
from batchllm.engine.llm_engine import LLMEngine


def create_engine(config: EngineConfig, tensor_parallel_size: int = 1, **tp_options) -> LLMEngine:
    """An LLMEngine on one device for tensor_parallel_size 1; above, a TPEngine whose model is
    split over that many processes (tp_options: TensorParallelConfig fields)."""
    if tensor_parallel_size == 1:
        return LLMEngine(config)
    if config.quantization is not None or config.kv_cache_dtype != "auto":
        raise ValueError("--quantization and --kv-cache-dtype fp8 run on one GPU; with --tensor-parallel-size "
                         f"{tensor_parallel_size} the model runs in bf16 (drop the FP8 flags)")
    from batchllm.distributed.config import TensorParallelConfig
    from batchllm.distributed.tp_engine import TPEngine

    return TPEngine(config, TensorParallelConfig(tensor_parallel_size=tensor_parallel_size, **tp_options))
