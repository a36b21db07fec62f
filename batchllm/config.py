"""The one frozen engine configuration, built once (CLI or `LLM(...)`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchllm.sched.config import SchedulerConfig

ATTENTION_BACKENDS = ("auto", "reference", "torch", "triton", "fused")
DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZATIONS = ("fp8",)
KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the default SmolLM2-135M-Instruct GGUF
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    # "fp8": the decoder's linear layers run e4m3 GEMMs (per-output-channel weight scales,
    # per-token activation scales); the embedding, LM head and norms stay in `dtype`. None: the
    # checkpoint's own format (an FP8 checkpoint runs in FP8).
    quantization: str | None = None
    # "fp8": the KV cache holds e4m3 values with one scale per cache (twice the tokens per
    # byte); "auto": the model dtype.
    kv_cache_dtype: str = "auto"
    device: str = "auto"  # auto: cuda if available, else cpu
    max_model_len: int | None = None  # None: the model's own limit
    # KV cache size in tokens; None: sized from free GPU memory (CPU: 32768).
    kv_cache_tokens: int | None = None
    gpu_memory_utilization: float = 0.90
    attention_backend: str = "auto"  # auto: fused Triton on CUDA, batched PyTorch on CPU
    seed: int = 0  # seeds requests that have no seed of their own
    # Triton kernels for RMSNorm / RoPE / SwiGLU; None: on for CUDA, off on CPU.
    fused_kernels: bool | None = None
    # True: never capture CUDA graphs (decode steps run eagerly; for debugging and comparison).
    enforce_eager: bool = False
    # True: schedule and launch step N+1 while the GPU runs step N; its decode rows take their
    # input ids from step N's sampled tokens on the device (a request that stops by EOS or a
    # stop string at step N costs one wasted row in step N+1). False: one step at a time.
    async_scheduling: bool = True
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} (or None), got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise ValueError("kv_cache_tokens must be >= 1")
        if not (0.05 <= self.gpu_memory_utilization <= 1.0):
            raise ValueError("gpu_memory_utilization must be in [0.05, 1]")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
