"""The lower bounds of a workload's schedule, without a GPU: what `batchllm bench` reports beside
each row's wall time, and the floor the bf16 GEMMs set under it.

For each workload and policy the scheduler runs on the host (perf/schedule_replay.py, the steps a
bench run makes) and every step is charged:
  flop_bound_s           all FLOPs at the peak (692.3 TFLOP/s bf16): arithmetic only
  roofline_s             per step max(FLOPs / peak, bytes read / 4.2 TB/s) (perf/roofline.py)
  serial_roofline_s      per step the linear part (weights, LM head) and attention (KV) each at its
                         own max(FLOPs / peak, bytes / bandwidth), added: the engine runs them one
                         after the other
  serial_at_gemm_rate_s  the same with the linear part at --gemm-tflops (default: the peak, the
                         692.3 TFLOP/s bf16 GEMMs sustain on an H200, benchmarks/gemm_peak.py) and
                         attention at --attention-tflops (default: the peak)
  attention_roofline_s   that serial roofline's attention part alone
--quantization fp8 charges what the bench's FP8 rows run: FP8 weights and KV cache (one byte an
element; the LM head stays bf16) and every FLOP at the FP8 GEMM's peak, 1338.1 TFLOP/s. Prompt
attention runs below that: the `fused` backend's bf16 products (cuDNN's dense causal calls, 514-622
TFLOP/s on an H200, BENCHMARKS.md: --attention-tflops 595) or the `xqa` backend's FP8 products on
FA3 (856 TFLOP/s on a causal square of 16,384 rows, ops/fa3_dense.py: --attention-tflops 856).
The FLOP bound here is the policy's own work (its recomputed prefixes included); for batchllm it is
the bench rows' flop_bound_s. Each *_over_flop_bound divides by the batchllm policy's FLOP bound of
the workload, the bench rows' denominator.

    PYTHONPATH=. python3 benchmarks/bounds.py --out bounds.json
    PYTHONPATH=. python3 benchmarks/bounds.py --workload micro:64:16:4#16 --policies batchllm,vllm
    PYTHONPATH=. python3 benchmarks/bounds.py --policies batchllm --quantization fp8 --attention-tflops 595
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from batchllm.perf.flop_bound import H200_BF16_PEAK_FLOPS, peak_flops_for
from batchllm.perf.roofline import (H200_COPY_BANDWIDTH_BYTES_PER_S, TrafficModel, roofline, step_byte_parts,
                                     step_flop_parts)
from batchllm.perf.schedule_replay import replay_schedule
from batchllm.perf.workload import make_workload, split_workload_spec
from batchllm.models.presets import PRESETS
from batchllm.sched.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, SchedulerConfig

WORKLOADS = ("micro:2000:200:16#1024", "industrial#2000", "micro:2000:1000:4#1024", "micro:16000:200:16#512")


def serial_parts(arch, steps, traffic: TrafficModel, gemm_flops: float, attention_flops_rate: float,
                 bandwidth: float) -> tuple[float, float]:
    """The serial roofline's (linear part with its FLOPs at gemm_flops (FLOP/s), attention part
    with its FLOPs at attention_flops_rate), each summed over the steps."""
    linear_s = attention_s = 0.0
    for work in steps:
        (linear_flops, attention_flops), (weights, kv) = step_flop_parts(arch, work), step_byte_parts(arch, traffic, work)
        linear_s += max(linear_flops / gemm_flops, weights / bandwidth)
        attention_s += max(attention_flops / attention_flops_rate, kv / bandwidth)
    return linear_s, attention_s


def bound_rows(workload_text: str, policies: list[str], model: str, kv_cache_tokens: int, block_size: int,
               output_tokens: int, budget: int, gemm_flops: float | None = None,
               attention_flops_rate: float | None = None, quantization: str = "none") -> list[dict]:
    """gemm_flops, attention_flops_rate: FLOP/s (None: the quantization's peak)."""
    arch = PRESETS[model]
    spec, num_requests = split_workload_spec(workload_text, 1024)
    workload = make_workload(spec, num_requests, output_tokens, arch.vocab_size, 0)
    prompts = [p.tolist() for p in workload.prompts]
    element_bytes = 1 if quantization == "fp8" else 2  # FP8 weights and KV cache, else bf16
    kv_bytes = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * element_bytes  # K and V
    traffic = TrafficModel(weight_bytes_per_element=element_bytes, lm_head_bytes_per_element=2,
                           kv_bytes_per_token=kv_bytes)
    peak, bandwidth = peak_flops_for(quantization), H200_COPY_BANDWIDTH_BYTES_PER_S
    gemm_flops, attention_flops_rate = gemm_flops or peak, attention_flops_rate or peak
    rows = []
    for policy in policies:
        config = SchedulerConfig(policy=policy, num_kv_blocks=kv_cache_tokens // block_size, block_size=block_size,
                                 max_num_batched_tokens=budget)
        steps = replay_schedule(prompts, workload.max_tokens, config).steps
        flops = sum(sum(step_flop_parts(arch, work)) for work in steps)
        bound = roofline(arch, steps, traffic, peak, bandwidth)
        linear_s, attention_s = serial_parts(arch, steps, traffic, gemm_flops, attention_flops_rate, bandwidth)
        rows.append({"workload": workload_text, "policy": policy, "quantization": quantization, "steps": len(steps),
                     "flop_bound_s": flops / peak, "roofline_s": bound.seconds,
                     "serial_roofline_s": bound.serial_seconds, "serial_at_gemm_rate_s": linear_s + attention_s,
                     "attention_roofline_s": attention_s})
    reference = next((row["flop_bound_s"] for row in rows if row["policy"] == "batchllm"), None)
    for row in rows:
        for key in ("roofline_s", "serial_roofline_s", "serial_at_gemm_rate_s"):
            if reference:
                row[key.removesuffix("_s") + "_over_flop_bound"] = round(row[key] / reference, 3)
        for key in ("flop_bound_s", "roofline_s", "serial_roofline_s", "serial_at_gemm_rate_s", "attention_roofline_s"):
            row[key] = float(f"{row[key]:.5g}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", action="append", help=f"WORKLOAD[#REQUESTS], repeatable (default: {WORKLOADS})")
    parser.add_argument("--policies", default="batchllm,vllm,sglang")
    parser.add_argument("--model", default="llama-3.1-8b", choices=sorted(PRESETS), help="architecture preset")
    parser.add_argument("--kv-cache-tokens", type=int, default=500_000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=100)
    parser.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS)
    parser.add_argument("--quantization", default="none", choices=["none", "fp8"],
                        help="fp8: FP8 weights and KV cache, the FP8 GEMM's peak (default: none, bf16)")
    parser.add_argument("--gemm-tflops", type=float, default=None,
                        help="the rate the linear layers' GEMMs run at (TFLOP/s; default: the peak, "
                             f"{H200_BF16_PEAK_FLOPS / 1e12:g} for bf16, the rate bf16 GEMMs sustain on an H200)")
    parser.add_argument("--attention-tflops", type=float, default=None,
                        help="the rate attention's FLOPs run at (TFLOP/s; default: the peak)")
    parser.add_argument("--out", default=None, help="write the rows here (JSON)")
    args = parser.parse_args(argv)
    for name in ("gemm_tflops", "attention_tflops"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    rates = [None if rate is None else rate * 1e12 for rate in (args.gemm_tflops, args.attention_tflops)]
    rows = []
    for text in args.workload or WORKLOADS:
        for row in bound_rows(text, args.policies.split(","), args.model, args.kv_cache_tokens, args.block_size,
                              args.output_tokens, args.max_num_batched_tokens, *rates, args.quantization):
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as handle:
            json.dump({"model": args.model, "quantization": args.quantization, "gemm_tflops": args.gemm_tflops,
                       "attention_tflops": args.attention_tflops, "rows": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
