"""What an engine runs on, and how a single-device engine builds it: the model on its device,
the KV cache sized from free memory, the model runner."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchllm.config import EngineConfig
from batchllm.engine.graph_shapes import DECODE_ROWS_BUCKETS, graph_slots_capacity
from batchllm.engine.kv_cache import KVCache, choose_num_kv_tokens, kv_bytes_per_token, num_kv_blocks
from batchllm.engine.model_runner import ModelRunner, graph_capacity
from batchllm.engine.step_buffers import ActivationShape, StepBuffers
from batchllm.models.config import ModelArchConfig
from batchllm.models.fp8_linear import require_fp8_device
from batchllm.ops.fp8 import FP8_DTYPE


@dataclass(frozen=True)
class EngineParts:
    """Built once per engine: by `load_parts` on one device, or per rank by the TP engine."""

    device: torch.device
    dtype: torch.dtype
    arch: ModelArchConfig  # the full model's architecture
    model_name: str
    tokenizer_source: dict | None
    max_model_len: int
    kv_cache: KVCache
    runner: ModelRunner


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def kv_cache_dtype(config: EngineConfig, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's element type; checks up front (before any weight loads) that FP8 can run."""
    if config.quantization == "fp8" and dtype != torch.bfloat16:
        raise ValueError(f"--quantization fp8 computes in bfloat16; got --dtype {config.dtype}")
    if config.cache.kv_cache_dtype != "fp8":
        return dtype
    require_fp8_device(device, "--kv-cache-dtype fp8", "Use --kv-cache-dtype auto: the cache in the model dtype.")
    return FP8_DTYPE


def model_len_limit(config: EngineConfig, arch) -> int:
    limit = arch.max_position_embeddings
    return min(config.max_model_len or limit, limit)


def prepare_model(model, config: EngineConfig, max_model_len: int, device: torch.device) -> None:
    """Build the RoPE table once, up front (growing it later would need a device sync), and
    choose the fused layer kernels (on for CUDA unless the config says otherwise)."""
    model.rotary.ensure_capacity(max_model_len, device)
    model.fused_kernels = device.type == "cuda" if config.fused_kernels is None else config.fused_kernels


def activation_reserve_bytes(config: EngineConfig, arch, dtype: torch.dtype) -> int:
    """GPU memory kept out of the KV cache: activations of the largest step (hidden states,
    fused gate-up output), logits and 1 GiB of slack; with CUDA graphs also their step buffers and
    their one memory pool, which holds the temporaries of the largest graph: a piece of the
    largest step, or a decode graph with its attention's partial results."""
    per_token = dtype.itemsize * (8 * arch.hidden_size + 3 * arch.intermediate_size)
    max_num_tokens = config.scheduler.max_num_batched_tokens
    reserve = max_num_tokens * per_token + 1024 * arch.vocab_size * 4 * 3 + (1 << 30)
    if not config.enforce_eager:
        shape = ActivationShape(arch.hidden_size, arch.num_heads, arch.head_dim, dtype)
        capacity = graph_capacity(max_num_tokens)
        decode_rows = min(capacity, DECODE_ROWS_BUCKETS[-1])
        partials = graph_slots_capacity(decode_rows) * arch.num_heads * (arch.head_dim + 1) * 4  # float32
        reserve += max(max_num_tokens * per_token, decode_rows * per_token + partials)
        reserve += StepBuffers.num_bytes(capacity, shape, activations=True)
    return reserve


def load_parts(config: EngineConfig) -> EngineParts:
    """The whole model on one device, a KV cache in what memory is left, a ModelRunner."""
    from batchllm.models.loader import load_model

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    kv_dtype = kv_cache_dtype(config, dtype, device)
    loaded = load_model(config.model, dtype=dtype, device=device, quantization=config.quantization)
    arch = loaded.config
    max_model_len = model_len_limit(config, arch)
    prepare_model(loaded.model, config, max_model_len, device)
    block_size = config.scheduler.block_size
    bytes_per_token = kv_bytes_per_token(arch.num_layers, arch.num_kv_heads, arch.head_dim, kv_dtype)
    num_kv_tokens = choose_num_kv_tokens(device, bytes_per_token, config.cache,
                                         activation_reserve_bytes(config, arch, dtype))
    kv_cache = KVCache.allocate(arch.num_layers, num_kv_blocks(num_kv_tokens, block_size), block_size,
                                arch.num_kv_heads, arch.head_dim, kv_dtype, device)
    # With CUDA graphs the runner captures its piecewise graphs here, before any step.
    runner = ModelRunner(loaded.model, arch, kv_cache, block_size, device, config.attention_backend,
                         cuda_graphs=not config.enforce_eager,
                         max_num_tokens=config.scheduler.max_num_batched_tokens)
    return EngineParts(device, dtype, arch, loaded.name, loaded.tokenizer_source, max_model_len,
                       kv_cache, runner)
