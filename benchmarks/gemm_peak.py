"""Matmul peaks of the GPU: an M=N=K=8192 bf16 matmul and the same in FP8 through torch._scaled_mm.

FP8: float8_e4m3fn operands, the second one column-major (b.t() of a row-major [N, K] tensor),
float32 row-wise scales (scale_a [M, 1], scale_b [1, N]), bf16 output; measured with
use_fast_accum off and on. Each figure is timed with CUDA events over --iters products after
--warmup untimed ones, --repeats times; TFLOP/s counts 2*M*N*K per product. Prints the median and
the spread over the repeats and writes JSON to --out. The bench's FP8 FLOP bound divides by the
FP8 peak (batchllm/perf/flop_bound.py). Runs on torch 2.11 and later.

On a GPU each figure also records the SM clock and board power that nvidia-smi reads every 50 ms
from the first warm-up product to the last timed one (`clocks`), and the result the rated
maximum SM clock and power limit: a sustained bf16 matmul on random data can run below the
maximum clock, and then below the peak of a short run; the power beside the clock tells whether
the power limit is the reason.

    PYTHONPATH=. python3 benchmarks/gemm_peak.py --out benchmarks/results/gemm_peak.json
    PYTHONPATH=. python3 benchmarks/gemm_peak.py --dry-run   # small shapes on the CPU: checks the code only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from batchllm.models.fp8_linear import fp8_unsupported_reason

FP8_DTYPE = torch.float8_e4m3fn


@dataclass(frozen=True)
class TimingOptions:
    repeats: int = 5
    iters: int = 50  # products per repeat
    warmup: int = 20  # untimed products before the first repeat (the clocks ramp up meanwhile)


def time_per_call_s(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Seconds per call of fn, over iters calls (CUDA events on a GPU, a wall clock elsewhere)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    started = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - started) / iters


def parse_smi_samples(text: str) -> list[tuple[float, float]]:
    """(SM MHz, board W) of each line of `nvidia-smi --query-gpu=clocks.sm,power.draw
    --format=csv,noheader,nounits` output ('1395, 552.46'); lines it cannot read ('[N/A]') are
    skipped."""
    samples = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            samples.append((float(parts[0]), float(parts[1])))
        except (ValueError, IndexError):
            continue
    return samples


class GpuClockSampler:
    """Samples one GPU's SM clock and board power with nvidia-smi while the `with` block runs.
    Without the executable, `summary()` says so and nothing is sampled."""

    def __init__(self, gpu_index: int, interval_ms: int = 50, executable: str = "nvidia-smi") -> None:
        self.gpu_index, self.interval_ms, self.executable = gpu_index, interval_ms, executable
        self.samples: list[tuple[float, float]] = []
        self.missing = shutil.which(executable) is None
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> "GpuClockSampler":
        if self.missing:
            return self
        self._process = subprocess.Popen(
            [self.executable, f"--id={self.gpu_index}", "--query-gpu=clocks.sm,power.draw",
             "--format=csv,noheader,nounits", f"--loop-ms={self.interval_ms}"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        # the first sample is out before the timed work starts, so the samples cover all of it
        self.samples += parse_smi_samples(self._process.stdout.readline())
        return self

    def __exit__(self, *exc) -> None:
        if self._process is None:
            return
        self._process.terminate()
        remaining, _ = self._process.communicate(timeout=10)
        self.samples += parse_smi_samples(remaining)
        self._process = None

    def summary(self) -> dict:
        if self.missing:
            return {"samples": 0, "note": f"{self.executable} not found"}
        if not self.samples:
            return {"samples": 0}
        mhz = [m for m, _ in self.samples]
        watts = [w for _, w in self.samples]
        return {"samples": len(self.samples), "sm_mhz_median": statistics.median(mhz), "sm_mhz_min": min(mhz),
                "sm_mhz_max": max(mhz), "power_w_median": round(statistics.median(watts), 1),
                "power_w_max": round(max(watts), 1)}


def rated_limits(gpu_index: int, executable: str = "nvidia-smi") -> dict:
    """The GPU's maximum SM clock and power limit, as nvidia-smi reports them ({} without it)."""
    if shutil.which(executable) is None:
        return {}
    out = subprocess.run([executable, f"--id={gpu_index}", "--query-gpu=clocks.max.sm,power.limit",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30).stdout
    parsed = parse_smi_samples(out)
    return {"sm_mhz_rated_max": parsed[0][0], "power_limit_w": parsed[0][1]} if parsed else {}


def measure_tflops(fn: Callable[[], object], flops: float, device: torch.device, timing: TimingOptions,
                   sampler: GpuClockSampler | None = None) -> dict:
    """TFLOP/s of fn over the repeats; with a sampler, the clocks and power from the first warm-up
    call to the last timed one under `clocks`."""
    with sampler if sampler is not None else nullcontext():
        for _ in range(timing.warmup):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        rates = [flops / time_per_call_s(fn, device, timing.iters) / 1e12 for _ in range(timing.repeats)]
    figures = {"tflop_per_s_median": round(statistics.median(rates), 1), "tflop_per_s_min": round(min(rates), 1),
               "tflop_per_s_max": round(max(rates), 1), "tflop_per_s_repeats": [round(r, 1) for r in rates]}
    if sampler is not None:
        figures["clocks"] = sampler.summary()
    return figures


@dataclass
class Fp8Operands:
    a: torch.Tensor  # [M, K] float8_e4m3fn, row-major
    b: torch.Tensor  # [K, N] float8_e4m3fn, column-major (the transpose of a row-major [N, K])
    scale_a: torch.Tensor  # [M, 1] float32
    scale_b: torch.Tensor  # [1, N] float32

    def product(self, use_fast_accum: bool) -> torch.Tensor:
        return torch._scaled_mm(self.a, self.b, scale_a=self.scale_a, scale_b=self.scale_b,
                                out_dtype=torch.bfloat16, use_fast_accum=use_fast_accum)


def fp8_operands(m: int, n: int, k: int, device: torch.device, generator: torch.Generator) -> Fp8Operands:
    """Normal values (well inside e4m3's range) and row-wise scales around 1."""
    a = torch.randn(m, k, device=device, generator=generator).to(FP8_DTYPE)
    b = torch.randn(n, k, device=device, generator=generator).to(FP8_DTYPE).t()
    scale_a = torch.rand(m, 1, device=device, generator=generator) + 0.5
    scale_b = torch.rand(1, n, device=device, generator=generator) + 0.5
    return Fp8Operands(a, b, scale_a, scale_b)


def check_fp8_product(operands: Fp8Operands, rows: int = 256) -> float:
    """Largest relative error of the first rows x rows block of the FP8 product against float32
    arithmetic on the same e4m3 values (a wrong layout or scale gives errors near 1)."""
    got = operands.product(use_fast_accum=False)[:rows, :rows].float()
    a = operands.a[:rows].float() * operands.scale_a[:rows]
    b = operands.b[:, :rows].float() * operands.scale_b[:, :rows]
    want = a @ b
    return float((got - want).abs().max() / want.abs().max())


def run(size: int, device: torch.device, timing: TimingOptions, log: Callable[[str], None] = print) -> dict:
    generator = torch.Generator(device=device).manual_seed(0)
    flops = 2.0 * size ** 3
    result: dict = {"shape_mnk": [size, size, size], "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
                    "repeats": timing.repeats, "iters_per_repeat": timing.iters}
    on_gpu = device.type == "cuda"
    gpu_index = device.index or 0  # nvidia-smi numbering unless CUDA_VISIBLE_DEVICES remaps it
    if on_gpu:
        result.update(rated_limits(gpu_index))
    sampler = (lambda: GpuClockSampler(gpu_index)) if on_gpu else (lambda: None)
    a = torch.randn(size, size, device=device, generator=generator, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, generator=generator, dtype=torch.bfloat16)
    result["bf16"] = measure_tflops(lambda: a @ b, flops, device, timing, sampler())
    log(_line("bf16 matmul", result["bf16"]))
    del a, b
    operands = fp8_operands(size, size, size, device, generator)
    result["fp8_rowwise_max_rel_error"] = check_fp8_product(operands)
    if result["fp8_rowwise_max_rel_error"] > 0.02:
        raise RuntimeError(f"the FP8 product is wrong (relative error {result['fp8_rowwise_max_rel_error']:.3g})")
    for key, fast in (("fp8_rowwise", False), ("fp8_rowwise_fast_accum", True)):
        result[key] = measure_tflops(lambda: operands.product(fast), flops, device, timing, sampler())
        log(_line(f"fp8 _scaled_mm (row-wise scales, use_fast_accum={fast})", result[key]))
    bf16_median = result["bf16"]["tflop_per_s_median"]
    result["fp8_over_bf16"] = round(result["fp8_rowwise"]["tflop_per_s_median"] / bf16_median, 3) if bf16_median else None
    return result


def _line(label: str, figures: dict) -> str:
    clocks = figures.get("clocks", {})
    at = (f", SM {clocks['sm_mhz_min']:.0f}-{clocks['sm_mhz_max']:.0f} MHz, up to {clocks['power_w_max']:.0f} W"
          if clocks.get("samples") else "")
    return (f"{label}: {figures['tflop_per_s_median']:,.1f} TFLOP/s median "
            f"(min {figures['tflop_per_s_min']:,.1f}, max {figures['tflop_per_s_max']:,.1f}, "
            f"{len(figures['tflop_per_s_repeats'])} repeats{at})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/gemm_peak.json", metavar="FILE.json",
                        help="where to write the JSON (default benchmarks/results/gemm_peak.json)")
    parser.add_argument("--size", type=int, default=8192, help="M = N = K (default 8192)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats; median and spread over them (default 5)")
    parser.add_argument("--iters", type=int, default=50, help="products per repeat (default 50)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed products first (default 20)")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:1 ... (default cuda)")
    parser.add_argument("--dry-run", action="store_true",
                        help="size 256, 1 repeat of 2 products on the CPU, nothing written: checks the code runs")
    args = parser.parse_args(argv)
    if args.dry_run:
        device, size, timing = torch.device("cpu"), 256, TimingOptions(repeats=1, iters=2, warmup=1)
    else:
        device, size = torch.device(args.device), args.size
        timing = TimingOptions(repeats=args.repeats, iters=args.iters, warmup=args.warmup)
        reason = fp8_unsupported_reason(device)
        if reason:
            print(f"error: {reason} (--dry-run checks the code on a CPU)", file=sys.stderr)
            return 2
    result = run(size, device, timing)
    if args.dry_run:
        return 0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        handle.write(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
