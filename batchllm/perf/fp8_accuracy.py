"""The FP8 accuracy gate: one text through the engine in bf16 and in FP8, compared position by
position (benchmarks/fp8_accuracy.py is its command line).

Each variant is built as the engine builds itself (`load_parts(EngineConfig(...))`) and the whole
text runs as ONE sequence through its ModelRunner, prefilled in chunks: every chunk after the first
reads the earlier tokens' keys and values back from the paged KV cache, so an FP8 KV cache is
exercised as in serving. The hidden states of every position go through the model's LM head; the
logits are compared with the reference's (batchllm/perf/logit_metrics.py)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from batchllm.perf.logit_metrics import compare_next_token, perplexity
from batchllm.sched.interface import ScheduledChunk, SchedulerOutput

SEQ_ID = 0


@dataclass(frozen=True)
class Variant:
    name: str  # the result's key
    quantization: str | None = None  # EngineConfig.quantization
    kv_cache_dtype: str = "auto"  # EngineConfig.kv_cache_dtype


FP8_VARIANTS = (
    Variant("weights_activations", quantization="fp8", kv_cache_dtype="auto"),
    Variant("weights_activations_kv", quantization="fp8", kv_cache_dtype="fp8"),
)
REFERENCE_VARIANT = Variant("reference")  # options.dtype, no quantization


@dataclass(frozen=True)
class AccuracyOptions:
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct GGUF)
    chunk_tokens: int = 512  # prefill chunk: later chunks read earlier tokens from the KV cache
    dtype: str = "bfloat16"  # the reference's dtype, and the FP8 variants' unquantized parts
    device: str = "auto"  # auto: cuda if available
    attention_backend: str = "auto"  # xqa: the FP8-KV variant's; the others run fused (variant_attention_backend)
    # xqa only: chunks of at least this many rows attend by FA3's dense calls (use_fa3_from), as a
    # model with heads of 128 does from 512 rows, where the heads' prefill table makes none (heads
    # of 64, the default model's); None: the engine's table
    fa3_min_rows: int | None = None

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be at least 1, got {self.chunk_tokens}")
        if self.fa3_min_rows is not None and (self.fa3_min_rows < 1 or self.attention_backend != "xqa"):
            raise ValueError(f"fa3_min_rows takes a positive row count and the xqa backend, got "
                             f"{self.fa3_min_rows} with {self.attention_backend!r}")


def prefill_steps(token_ids: Sequence[int], chunk_tokens: int, block_size: int) -> list[SchedulerOutput]:
    """The steps that prefill token_ids as one sequence, chunk_tokens at a time. Its KV blocks are
    0, 1, 2, ... in order; each chunk appends the blocks its own positions need."""
    steps = []
    num_blocks = 0
    for step_index, start in enumerate(range(0, len(token_ids), chunk_tokens)):
        end = min(start + chunk_tokens, len(token_ids))
        needed = -(-end // block_size)
        chunk = ScheduledChunk(seq_id=SEQ_ID, token_ids=tuple(int(t) for t in token_ids[start:end]),
                               start_position=start, num_tokens=end - start,
                               new_block_ids=tuple(range(num_blocks, needed)),
                               block_ids_start=num_blocks)
        steps.append(SchedulerOutput.from_chunks(step_index, [chunk], num_running_requests=1, num_used_blocks=needed))
        num_blocks = needed
    return steps


@torch.inference_mode()
def sequence_logits(parts, token_ids: Sequence[int], chunk_tokens: int) -> torch.Tensor:
    """float32 logits [len(token_ids), vocab] of every position, on the parts' device.
    parts: an EngineParts whose KV cache holds at least len(token_ids) tokens."""
    runner = parts.runner
    capacity = parts.kv_cache.num_blocks * runner.block_size
    if len(token_ids) > capacity:
        raise ValueError(f"{len(token_ids)} tokens do not fit the KV cache of {capacity} tokens")
    if len(token_ids) > parts.max_model_len:
        raise ValueError(f"{len(token_ids)} tokens exceed the model's length limit of {parts.max_model_len}")
    logits = None
    for step in prefill_steps(token_ids, chunk_tokens, runner.block_size):
        hidden = runner.forward(runner.step_inputs(step), allow_graph=False)
        chunk_logits = runner.model.compute_logits(hidden)
        if logits is None:
            logits = torch.empty((len(token_ids), chunk_logits.shape[-1]), dtype=torch.float32,
                                 device=chunk_logits.device)
        start = step.chunks[0].start_position
        logits[start:start + step.chunks[0].num_tokens] = chunk_logits
    return logits


def variant_attention_backend(name: str, variant: Variant) -> str:
    """The attention backend a variant runs: `xqa` attends FP8 caches only, so the variants with a
    bf16 cache run `fused`, the backend xqa extends; any other name is every variant's."""
    if name == "xqa" and variant.kv_cache_dtype != "fp8":
        return "fused"
    return name


def use_fa3_from(backend, min_rows: int) -> None:
    """Give a backend that runs FA3's dense calls (`xqa` on Hopper) dense calls from min_rows rows,
    each chunk's causal call holding its context: the whole prompt attention of such a chunk on
    FA3's FP8 products. A RuntimeError where the backend has no FA3."""
    if getattr(backend, "fa3_dense", None) is None:
        raise RuntimeError("the FP8-KV variant's backend runs no FA3 (FA3 needs the xqa backend, FlashInfer and a "
                           "Hopper GPU; its build may have failed: see the warning above)")
    backend.prefill_tile = dataclasses.replace(backend.prefill_tile, dense_min_rows=min_rows,
                                               dense_causal_min_rows=min_rows)


def engine_config(options: AccuracyOptions, variant: Variant, num_tokens: int):
    """The EngineConfig of one variant: a KV cache of just enough whole blocks, no CUDA graphs."""
    from batchllm.config import CacheConfig, EngineConfig

    config = EngineConfig(model=options.model, dtype=options.dtype, device=options.device,
                          quantization=variant.quantization,
                          attention_backend=variant_attention_backend(options.attention_backend, variant),
                          enforce_eager=True)
    block_size = config.scheduler.block_size
    cache = CacheConfig(kv_cache_tokens=-(-num_tokens // block_size) * block_size, kv_cache_dtype=variant.kv_cache_dtype)
    return dataclasses.replace(config, cache=cache)


def variant_logits(options: AccuracyOptions, variant: Variant, token_ids: Sequence[int]) -> tuple[str, torch.Tensor]:
    """(the model's name, logits of every position) of one variant; its model and KV cache are
    freed before returning (one variant on the device at a time)."""
    from batchllm.perf.device_memory import free_device_memory
    from batchllm.engine.loading import load_parts

    config = engine_config(options, variant, len(token_ids))
    parts = load_parts(config)
    try:
        if options.fa3_min_rows is not None and config.attention_backend == "xqa":
            use_fa3_from(parts.runner.backend, options.fa3_min_rows)
        return parts.model_name, sequence_logits(parts, token_ids, options.chunk_tokens)
    finally:
        del parts
        free_device_memory()


def measure_fp8_accuracy(token_ids: Sequence[int], options: AccuracyOptions = AccuracyOptions(),
                         variants: Sequence[Variant] = FP8_VARIANTS,
                         log: Callable[[str], None] = print) -> dict:
    """Run token_ids through the reference (options.dtype, no quantization) and every variant; for
    each variant against the reference: perplexity ratio, mean KL(p_ref || p_variant), top-1
    agreement. Returns {"model", "tokens", "bf16_perplexity", NAME: {"perplexity_ratio", "kl",
    "top1_agreement", "perplexity"} for each variant}."""
    token_ids = [int(t) for t in token_ids]
    started = time.perf_counter()
    model_name, reference = variant_logits(options, REFERENCE_VARIANT, token_ids)
    reference_perplexity = perplexity(reference, token_ids)
    log(f"{REFERENCE_VARIANT.name} ({options.dtype}): perplexity {reference_perplexity:.4f} over "
        f"{len(token_ids)} tokens ({time.perf_counter() - started:.1f} s)")
    result: dict = {"model": model_name, "tokens": len(token_ids), "bf16_perplexity": reference_perplexity}
    for variant in variants:
        started = time.perf_counter()
        _, logits = variant_logits(options, variant, token_ids)
        metrics = compare_next_token(reference, logits, token_ids)
        del logits
        result[variant.name] = {"perplexity_ratio": metrics.perplexity_ratio, "kl": metrics.kl,
                                "top1_agreement": metrics.top1_agreement, "perplexity": metrics.perplexity}
        log(f"{variant.name} (quantization {variant.quantization}, kv cache {variant.kv_cache_dtype}): "
            f"perplexity {metrics.perplexity:.4f} (ratio {metrics.perplexity_ratio:.4f}), KL {metrics.kl:.5f}, "
            f"top-1 agreement {metrics.top1_agreement:.2%} ({time.perf_counter() - started:.1f} s)")
    return result


@dataclass(frozen=True)
class Gate:
    """What a variant must reach against the reference to pass."""

    max_perplexity_ratio: float
    min_top1_agreement: float


GATES = {
    "weights_activations": Gate(max_perplexity_ratio=1.05, min_top1_agreement=0.8),
    "weights_activations_kv": Gate(max_perplexity_ratio=1.07, min_top1_agreement=0.8),
}


def gate_failures(result: dict, gates: dict[str, Gate] = GATES) -> list[str]:
    """One line per metric of a measure_fp8_accuracy result outside its gate (empty: passed)."""
    failures = []
    for name, gate in gates.items():
        metrics = result[name]
        if metrics["perplexity_ratio"] > gate.max_perplexity_ratio:
            failures.append(f"{name}: perplexity ratio {metrics['perplexity_ratio']:.4f} > {gate.max_perplexity_ratio}")
        if metrics["top1_agreement"] < gate.min_top1_agreement:
            failures.append(f"{name}: top-1 agreement {metrics['top1_agreement']:.4f} < {gate.min_top1_agreement}")
    return failures
