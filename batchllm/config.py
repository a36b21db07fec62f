"""The one frozen engine configuration: a tree of frozen dataclasses, built once (from the command
line or the `LLM(...)` arguments, see `engine_config`) and validated when it is built. Every part
of the engine takes the sub-config it needs. What the engine finds out at run time (the number of
KV blocks the cache holds, the device "auto" became) is the engine's state, never written back
here. Torch-free: checks that need the host (a GPU, its memory) are in engine/host_check.py."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from batchllm.sched.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, SchedulerConfig

# Share of the GPU's memory the engine may fill (weights, activations, KV cache).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.90

ATTENTION_BACKENDS = ("auto", "reference", "torch", "triton", "fused", "xqa")
DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZATIONS = ("fp8",)
KV_CACHE_DTYPES = ("auto", "fp8")
TENSOR_PARALLEL_BACKENDS = ("auto", "nccl", "gloo")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    # Capacity in tokens; None: sized from free GPU memory (CPU: 32768).
    kv_cache_tokens: int | None = None
    # "fp8": e4m3 values with one scale per cache (twice the tokens per byte); "auto": the model dtype.
    kv_cache_dtype: str = "auto"
    # Share of the GPU's memory the engine may fill (weights, activations, KV cache).
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise ValueError("kv_cache_tokens must be >= 1")
        if not (0.05 <= self.gpu_memory_utilization <= 1.0):
            raise ValueError("gpu_memory_utilization must be in [0.05, 1]")


@dataclass(frozen=True)
class TensorParallelConfig:
    """Tensor parallelism on one host: one process per GPU (docs/scale-out.md)."""

    size: int = 1  # processes (GPUs) the model is split across; 1: no tensor parallelism
    backend: str = "auto"  # torch.distributed backend; auto: nccl on CUDA, gloo on CPU
    master_port: int | None = None  # TCP rendezvous port on 127.0.0.1; None: a free one
    timeout_s: float = 600.0  # a collective waiting longer than this raises (a dead worker)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.size}")
        if self.backend not in TENSOR_PARALLEL_BACKENDS:
            raise ValueError(f"the tensor parallel backend must be auto, nccl or gloo, got {self.backend!r}")
        if self.timeout_s <= 0:
            raise ValueError("the tensor parallel timeout_s must be > 0")

    def resolve_backend(self, device_type: str) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if device_type == "cuda" else "gloo"


@dataclass(frozen=True)
class RayDPConfig:
    """Prefix-aware data parallelism on Ray actors, one engine per replica (docs/scale-out.md)."""

    num_replicas: int = 2
    gpus_per_replica: float | None = None  # None: 1 when the engine's device is CUDA, else 0
    cpus_per_replica: float = 1.0
    shards_per_replica: int = 1  # >1: smaller shards, handed to whichever replica is idle (dynamic balance)
    decode_token_weight: float = 1.0  # cost of a decode token relative to a prefill token
    stop_poll_s: float = 0.5  # with nothing arriving, the driver checks for a stop this often

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"--num-replicas must be >= 1, got {self.num_replicas}")
        if self.shards_per_replica < 1 or self.stop_poll_s <= 0:
            raise ValueError("shards_per_replica must be >= 1, stop_poll_s > 0")
        if self.gpus_per_replica is not None and self.gpus_per_replica < 0:
            raise ValueError("gpus_per_replica must be >= 0")


@dataclass(frozen=True)
class ParallelConfig:
    tensor: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    ray: RayDPConfig | None = None  # None: the engine runs in this process (and its TP workers)

    def __post_init__(self) -> None:
        if self.ray is not None and self.tensor.size > 1:
            raise ValueError("--tensor-parallel-size > 1 does not work with --ray (each replica runs one unsplit "
                             "engine): drop one of them")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the default SmolLM2-135M-Instruct GGUF
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    # "fp8": the decoder's linear layers run e4m3 GEMMs (per-output-channel weight scales,
    # per-token activation scales); the embedding, LM head and norms stay in `dtype`. None: the
    # checkpoint's own format (an FP8 checkpoint runs in FP8).
    quantization: str | None = None
    device: str = "auto"  # auto: cuda if available, else cpu; or cpu, cuda, cuda:N
    max_model_len: int | None = None  # None: the model's own limit
    attention_backend: str = "auto"  # auto: xqa where it fits, else fused Triton on CUDA; batched PyTorch on CPU
    seed: int = 0  # seeds requests that have no seed of their own
    # Triton kernels for RMSNorm / RoPE / SwiGLU; None: on for CUDA, off on CPU.
    fused_kernels: bool | None = None
    # True: never capture CUDA graphs (every step runs eagerly; for debugging and comparison).
    enforce_eager: bool = False
    # True: schedule and launch step N+1 while the GPU runs step N; its decode rows take their
    # input ids from step N's sampled tokens on the device (a request that stops by EOS or a
    # stop string at step N costs one wasted row in step N+1). False: one step at a time.
    async_scheduling: bool = True
    cache: CacheConfig = field(default_factory=CacheConfig)
    # The scheduling policy and its budgets. Its num_kv_blocks is not read: the engine gives the
    # scheduler the blocks its KV cache holds (LLMEngine.scheduler_config).
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} (or None), got {self.quantization!r}")
        if not _DEVICE.fullmatch(self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        block_size = self.scheduler.block_size
        if self.cache.kv_cache_tokens is not None and self.cache.kv_cache_tokens < block_size:
            raise ValueError(f"--kv-cache-tokens {self.cache.kv_cache_tokens} is less than one KV block "
                             f"(--block-size {block_size}): give at least {block_size}")
        uses_fp8 = self.quantization is not None or self.cache.kv_cache_dtype != "auto"
        if self.parallel.tensor.size > 1 and uses_fp8:
            raise ValueError("--quantization and --kv-cache-dtype fp8 run on one GPU; with --tensor-parallel-size "
                             f"{self.parallel.tensor.size} the model runs in bf16 (drop the FP8 flags)")


def engine_config(
    model: str | None = None,
    *,
    dtype: str = "auto",
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
    device: str = "auto",
    max_model_len: int | None = None,
    kv_cache_tokens: int | None = None,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    policy: str = "batchllm",
    block_size: int = 16,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    max_num_seqs: int | None = None,
    attention_backend: str = "auto",
    seed: int = 0,
    fused_kernels: bool | None = None,
    enforce_eager: bool = False,
    async_scheduling: bool = True,
    tensor_parallel_size: int = 1,
    ray_num_replicas: int | None = None,
) -> EngineConfig:
    """The tree from the flat options of `LLM(...)` and the command line (the same names and
    defaults). ray_num_replicas: data parallel on that many Ray replicas; None: no Ray."""
    ray = RayDPConfig(num_replicas=ray_num_replicas) if ray_num_replicas is not None else None
    return EngineConfig(
        model=model, dtype=dtype, quantization=quantization, device=device, max_model_len=max_model_len,
        attention_backend=attention_backend, seed=seed, fused_kernels=fused_kernels, enforce_eager=enforce_eager,
        async_scheduling=async_scheduling,
        cache=CacheConfig(kv_cache_tokens=kv_cache_tokens, kv_cache_dtype=kv_cache_dtype,
                          gpu_memory_utilization=gpu_memory_utilization),
        scheduler=SchedulerConfig(policy=policy, block_size=block_size, max_num_batched_tokens=max_num_batched_tokens,
                                  max_num_seqs=max_num_seqs),
        parallel=ParallelConfig(tensor=TensorParallelConfig(size=tensor_parallel_size), ray=ray),
    )
