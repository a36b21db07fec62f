"""Scheduler configuration (torch-free, frozen)."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("batchllm", "vllm", "sglang", "simple")
# Tokens per step unless the user says otherwise. On an H200 (Llama-3.1-8B), 8192 ran 2-35% faster
# than 2048 on every workload measured, FP8 and bf16; 16384 gained 3-5% more only on FP8 runs without
# shared prefixes (BENCHMARKS.md, "Token budget").
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


@dataclass(frozen=True)
class SchedulerConfig:
    """Sizes the scheduler works within. Token counts, not bytes: the engine converts the
    free GPU memory after the weights into `num_kv_blocks`."""

    policy: str = "batchllm"
    num_kv_blocks: int = 1024
    block_size: int = 16
    # N_chunk (BatchLLM 4.3.3): most tokens in one step.
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    # Request-count cap (vLLM's max_num_seqs). None = no cap (memory-centric batching).
    max_num_seqs: int | None = None
    # M_threshold (BatchLLM 4.3.3) as a fraction of the KV blocks; None = policy default.
    kv_memory_threshold: float | None = None
    # Prefix caching for the vllm / sglang policies (LRU). Ignored by batchllm and simple.
    enable_prefix_caching: bool = True
    # batchllm policy: fraction of each request's max_tokens whose KV blocks are reserved when
    # its group is admitted (1.0 = admitted requests can always decode to max_tokens without
    # preemption; lower values admit more aggressively and rely on recompute preemption).
    decode_reserve_ratio: float = 1.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1 or None")
        if self.kv_memory_threshold is not None and not (0.0 < self.kv_memory_threshold <= 1.0):
            raise ValueError("kv_memory_threshold must be in (0, 1]")
        if not (0.0 <= self.decode_reserve_ratio <= 1.0):
            raise ValueError("decode_reserve_ratio must be in [0, 1]")
