"""A compute-only bound on a run's time (docs/design.md, "Benchmark harness"): FLOPs of the work /
the GPU's measured matmul peak (bf16, or FP8 for a run with FP8 linear layers). It counts no
memory traffic, so decode steps, which are bound by reading the weights and the KV cache, can
take far longer than it says; roofline.py adds the bytes each step reads. Torch-free; `arch` is a
ModelArchConfig (num_params, num_layers, num_heads, head_dim, ...)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# An 8192^3 bf16 `a @ b` on an H200, sustained: median 692.3 TFLOP/s over 5 repeats of 50 products,
# 684.5-711.3 (benchmarks/gemm_peak.py). Short runs reach 780-810, which long runs of the engine's
# GEMMs do not.
H200_BF16_PEAK_FLOPS = 692.3e12
# An 8192^3 FP8 torch._scaled_mm (e4m3, row-wise scales, bf16 output, fast accumulation, as the
# engine's FP8 GEMMs run) on an H200: median 1338.1 TFLOP/s over 5 repeats, 1327.5-1359.0
# (benchmarks/gemm_peak.py)
H200_FP8_PEAK_FLOPS = 1338.1e12


def peak_flops_for(quantization: str | None) -> float:
    """The peak a run's bound is taken against: FP8 for quantization "fp8" (EngineConfig), else bf16.
    The whole work counts at that peak (attention and the LM head too, which stay bf16): the bound
    stays a lower bound."""
    return H200_FP8_PEAK_FLOPS if quantization == "fp8" else H200_BF16_PEAK_FLOPS


def plan_groups(plan) -> list[tuple[int, list[int], list[int]]]:
    """The `groups` argument of the functions below from a PrefixPlan (prefix/planner.py): per
    group (prefix tokens, [distinct tokens per member], [member request indices])."""
    return [(len(g.prefix_token_ids), [len(d) for d in g.distinct_token_ids], g.request_indices) for g in plan.groups]


def flop_bound_seconds(arch, groups, output_num_tokens: Sequence[int],
                       peak_flops: float = H200_BF16_PEAK_FLOPS) -> float:
    """work_flops(...) / peak_flops (FLOP/s)."""
    return work_flop_parts(arch, groups, output_num_tokens).bound_seconds(peak_flops)


@dataclass(frozen=True)
class WorkFlops:
    """The FLOPs of a workload's work by kind (work_flop_parts)."""

    linear: float  # the decoder's dense layers: 2 x non-embedding parameters per computed row
    attention: float  # QK^T and PV: 4 x layers x heads x head_dim per (row, attended key)
    lm_head: float  # 2 x vocab x hidden per sampled row

    @property
    def total(self) -> float:
        return self.linear + self.attention + self.lm_head

    @property
    def attention_share(self) -> float:
        return self.attention / self.total if self.total else 0.0

    def bound_seconds(self, peak_flops: float) -> float:
        """The FLOP bound: the whole work at peak_flops (FLOP/s)."""
        if peak_flops <= 0:
            raise ValueError(f"peak_flops must be positive, got {peak_flops}")
        return self.total / peak_flops


def work_flops(arch, groups, output_num_tokens: Sequence[int]) -> float:
    """The FLOPs of work_flop_parts, summed."""
    return work_flop_parts(arch, groups, output_num_tokens).total


def work_flop_parts(arch, groups, output_num_tokens: Sequence[int]) -> WorkFlops:
    """groups: (prefix_num_tokens, [distinct_num_tokens per member], [member request indices]).
    Counts every prefix once (optimal sharing), every distinct prompt and every decode step: the
    dense layers (2 x parameters per token), attention and the LM head of the rows that sample."""
    runs: list[tuple[int, int]] = []  # (first_position, num_tokens) of the rows computed
    num_sampled_rows = 0
    for prefix_num_tokens, distinct_lengths, members in groups:
        runs.append((0, prefix_num_tokens))
        for distinct, request in zip(distinct_lengths, members):
            runs.append((prefix_num_tokens, distinct + max(output_num_tokens[request] - 1, 0)))
            num_sampled_rows += output_num_tokens[request]
    processed_tokens = sum(count for _, count in runs)
    # a row at position p attends p + 1 keys (QK^T and PV in every layer)
    attended_keys = sum(count * first + count * (count + 1) // 2 for first, count in runs)
    return WorkFlops(linear=2.0 * arch.num_params(include_embeddings=False) * processed_tokens,
                     attention=4.0 * arch.num_layers * arch.num_heads * arch.head_dim * attended_keys,
                     lm_head=2.0 * arch.vocab_size * arch.hidden_size * num_sampled_rows)
