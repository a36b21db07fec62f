"""Matmul peaks of the GPU: an M=N=K=8192 bf16 matmul and the same in FP8 through torch._scaled_mm;
with --decode-rows, the FP8 linear layers of a decode step instead.

FP8: float8_e4m3fn operands, the second one column-major (b.t() of a row-major [N, K] tensor),
float32 row-wise scales (scale_a [M, 1], scale_b [1, N]), bf16 output; measured with
use_fast_accum off and on. Each figure is timed with CUDA events over --iters products after
--warmup untimed ones, --repeats times; TFLOP/s counts 2*M*N*K per product. Prints the median and
the spread over the repeats and writes JSON to --out. The bench's FP8 FLOP bound divides by the
FP8 peak (batchllm/perf/flop_bound.py). Runs on torch 2.11 and later.

    PYTHONPATH=. python3 benchmarks/gemm_peak.py --out gemm_peak.json
    PYTHONPATH=. python3 benchmarks/gemm_peak.py --dry-run   # small shapes on the CPU: checks the code only

--decode-rows 16,64,128: each linear layer of Llama-3.1-8B (or --layers llama-3.1-70b) at those rows,
as the FP8 model runs it (models/fp8_linear.Fp8Linear: the skinny GEMM where ops/fp8.skinny_config
picks it) beside torch._scaled_mm on the same operands, both timed as CUDA-graph replays over
copies of the weights that together exceed twice the L2 cache (a decode step reads every layer's
weights from HBM once).

    PYTHONPATH=. python3 benchmarks/gemm_peak.py --decode-rows 16,64,128 --out gemm_decode.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from batchllm.models.fp8_linear import Fp8Linear, fp8_unsupported_reason
from batchllm.ops.fp8 import fp8_linear, quantize_rows_reference

FP8_DTYPE = torch.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
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


def measure_tflops(fn: Callable[[], object], flops: float, device: torch.device, timing: TimingOptions) -> dict:
    """TFLOP/s of fn over the repeats: median, spread and every repeat."""
    for _ in range(timing.warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    rates = [flops / time_per_call_s(fn, device, timing.iters) / 1e12 for _ in range(timing.repeats)]
    return {"tflop_per_s_median": round(statistics.median(rates), 1), "tflop_per_s_min": round(min(rates), 1),
            "tflop_per_s_max": round(max(rates), 1), "tflop_per_s_repeats": [round(r, 1) for r in rates]}


@dataclasses.dataclass
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
    a = torch.randn(size, size, device=device, generator=generator, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, generator=generator, dtype=torch.bfloat16)
    result["bf16"] = measure_tflops(lambda: a @ b, flops, device, timing)
    log(_line("bf16 matmul", result["bf16"]))
    del a, b
    operands = fp8_operands(size, size, size, device, generator)
    result["fp8_rowwise_max_rel_error"] = check_fp8_product(operands)
    if result["fp8_rowwise_max_rel_error"] > 0.02:
        raise RuntimeError(f"the FP8 product is wrong (relative error {result['fp8_rowwise_max_rel_error']:.3g})")
    for key, fast in (("fp8_rowwise", False), ("fp8_rowwise_fast_accum", True)):
        result[key] = measure_tflops(lambda: operands.product(fast), flops, device, timing)
        log(_line(f"fp8 _scaled_mm (row-wise scales, use_fast_accum={fast})", result[key]))
    bf16_median = result["bf16"]["tflop_per_s_median"]
    result["fp8_over_bf16"] = round(result["fp8_rowwise"]["tflop_per_s_median"] / bf16_median, 3) if bf16_median else None
    return result


LAYER_SHAPES = {  # name: (N, K) of the FP8 linear layers, qkv and gate_up fused
    "llama-3.1-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "llama-3.1-70b": {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672)},
}
DRY_RUN_SHAPES = {"qkv": (384, 256), "down": (256, 512)}


def graph_seconds(fn: Callable[[], object], device: torch.device, timing: TimingOptions) -> float:
    """Median seconds per fn() over the repeats: replays of one CUDA graph of fn on a GPU (a call
    of a few microseconds would otherwise time its launch), eager calls elsewhere."""
    if device.type != "cuda":
        return statistics.median(time_per_call_s(fn, device, timing.iters) for _ in range(timing.repeats))
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()  # compiles, and allocates what the graph then keeps
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(timing.warmup):
        graph.replay()
    return statistics.median(time_per_call_s(graph.replay, device, timing.iters) for _ in range(timing.repeats))


def _fp8_layers(n: int, k: int, copies: int, device: torch.device, generator: torch.Generator) -> list[Fp8Linear]:
    layers = []
    for _ in range(copies):
        layer = Fp8Linear(k, n, False, torch.bfloat16).to(device)
        layer.weight.copy_((0.05 * torch.randn(n, k, device=device, generator=generator)).to(FP8_DTYPE))
        layer.weight_scale.copy_(torch.rand(n, device=device, generator=generator) + 0.5)
        layers.append(layer)
    return layers


def run_decode(rows_list: list[int], shapes: dict[str, tuple[int, int]], device: torch.device,
               timing: TimingOptions, log: Callable[[str], None] = print) -> dict:
    """Milliseconds per call of each FP8 linear layer at each row count: Fp8Linear and _scaled_mm."""
    generator = torch.Generator(device=device).manual_seed(0)
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 0
    rows_out: list[dict] = []
    for name, (n, k) in shapes.items():
        copies = max(2, -(-2 * l2_bytes // (n * k)))
        layers = _fp8_layers(n, k, copies, device, generator)
        for num_rows in rows_list:
            x = quantize_rows_reference(torch.randn(num_rows, k, device=device, generator=generator))
            layer_s = graph_seconds(lambda: [layer(x) for layer in layers], device, timing) / copies
            cublas_s = graph_seconds(lambda: [fp8_linear(x, layer.weight, layer.weight_scale, None, torch.bfloat16)
                                              for layer in layers], device, timing) / copies
            config = layers[0].skinny_config(num_rows) if device.type == "cuda" else None
            row = {"layer": name, "n": n, "k": k, "rows": num_rows, "fp8_linear_ms": round(layer_s * 1e3, 4),
                   "scaled_mm_ms": round(cublas_s * 1e3, 4),
                   "fp8_linear_weight_tb_per_s": round(n * k / layer_s / 1e12, 2),
                   "scaled_mm_weight_tb_per_s": round(n * k / cublas_s / 1e12, 2),
                   "kernel": "skinny" if config else "scaled_mm", "tiles": dataclasses.asdict(config) if config else None}
            rows_out.append(row)
            log(f"{name} [{n}, {k}] x {num_rows} rows: Fp8Linear {row['fp8_linear_ms']:.4f} ms ({row['kernel']}), "
                f"_scaled_mm {row['scaled_mm_ms']:.4f} ms")
        del layers
    totals = {}
    for num_rows in rows_list:
        mine = [r for r in rows_out if r["rows"] == num_rows]
        totals[str(num_rows)] = {"fp8_linear_ms": round(sum(r["fp8_linear_ms"] for r in mine), 4),
                                 "scaled_mm_ms": round(sum(r["scaled_mm_ms"] for r in mine), 4)}
        log(f"a decoder layer's linears at {num_rows} rows: Fp8Linear {totals[str(num_rows)]['fp8_linear_ms']:.4f} ms, "
            f"_scaled_mm {totals[str(num_rows)]['scaled_mm_ms']:.4f} ms")
    return {"torch": torch.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
            "repeats": timing.repeats, "iters_per_repeat": timing.iters, "layers": rows_out, "per_decoder_layer": totals}


def _line(label: str, figures: dict) -> str:
    return (f"{label}: {figures['tflop_per_s_median']:,.1f} TFLOP/s median "
            f"(min {figures['tflop_per_s_min']:,.1f}, max {figures['tflop_per_s_max']:,.1f}, "
            f"{len(figures['tflop_per_s_repeats'])} repeats)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gemm_peak.json", metavar="FILE.json",
                        help="where to write the JSON (default gemm_peak.json)")
    parser.add_argument("--size", type=int, default=8192, help="M = N = K (default 8192)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats; median and spread over them (default 5)")
    parser.add_argument("--iters", type=int, default=50, help="products per repeat (default 50)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed products first (default 20)")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:1 ... (default cuda)")
    parser.add_argument("--decode-rows", metavar="ROWS,...",
                        help="time the FP8 linear layers at these row counts instead (e.g. 16,64,128)")
    parser.add_argument("--layers", choices=sorted(LAYER_SHAPES), default="llama-3.1-8b",
                        help="whose layer shapes --decode-rows times (default llama-3.1-8b)")
    parser.add_argument("--dry-run", action="store_true",
                        help="size 256, 1 repeat of 2 products on the CPU, nothing written: checks the code runs")
    args = parser.parse_args(argv)
    decode_rows = [int(r) for r in args.decode_rows.split(",")] if args.decode_rows else None
    if args.dry_run:
        device, size, timing = torch.device("cpu"), 256, TimingOptions(repeats=1, iters=2, warmup=1)
    else:
        device, size = torch.device(args.device), args.size
        timing = TimingOptions(repeats=args.repeats, iters=args.iters, warmup=args.warmup)
        reason = fp8_unsupported_reason(device)
        if reason:
            print(f"error: {reason} (--dry-run checks the code on a CPU)", file=sys.stderr)
            return 2
    if decode_rows:
        shapes = DRY_RUN_SHAPES if args.dry_run else LAYER_SHAPES[args.layers]
        result = run_decode(decode_rows, shapes, device, timing)
    else:
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
