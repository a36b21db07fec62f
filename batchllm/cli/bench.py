"""`batchllm bench`: several scheduling policies in ONE process on the same model, side by side."""

from __future__ import annotations

import os
import sys

from batchllm.config import DEFAULT_GPU_MEMORY_UTILIZATION
from batchllm.perf.engine_variants import KV_CACHE_DTYPE_CHOICES, NO_QUANTIZATION, QUANTIZATION_CHOICES
from batchllm.perf.flop_bound import H200_BF16_PEAK_FLOPS, H200_FP8_PEAK_FLOPS
from batchllm.perf.roofline import H200_COPY_BANDWIDTH_BYTES_PER_S
from batchllm.sched.config import DEFAULT_MAX_NUM_BATCHED_TOKENS

DEFAULT_GPU_MODEL = "random:llama-3.1-8b"
CPU_SMOKE_MODEL = "random:tiny?vocab_size=32000"

EPILOG = """\
examples:
  # three policies on a GPU: 512 requests of micro 2000/200 sd16 (the table is printed; nothing written)
  batchllm bench --workload micro:2000:200:16 --policies batchllm,vllm,sglang

  # several workloads (#N = its request count), a bigger budget, and the HF generate peer timed at
  # batch sizes 64 and 128 on the first 128 requests of the first workload (the faster one reported)
  batchllm bench --model random:qwen2.5-7b --workload micro:2000:1000:4#1024 --workload industrial#2000 \\
      --policies batchllm@4096,batchllm,vllm --hf-peer 64,128 --out qwen.json --markdown qwen.md

  # TensorRT-LLM's uniform 128/128 row (30,000 requests of random 128-token prompts, 128 outputs each)
  # with FP8 weights and KV cache
  batchllm bench --workload uniform:128:128 --policies batchllm@8192 --quantization fp8 --kv-cache-dtype fp8

  # your own batch file (prompt_token_ids lines work with any model; text needs a tokenizer)
  batchllm bench --input requests.jsonl --policies batchllm,vllm

  # batchllm with and without asynchronous scheduling and CUDA graphs, rows saved under results/
  batchllm bench --workload micro:2000:200:16#1024 --policies batchllm,batchllm+sync,batchllm+eager \\
      --out results/bench.json

  # bf16 and FP8 engines in one invocation (FP8 needs a GPU of compute capability 8.9+, Ada/Hopper):
  # every policy runs on each, rows are tagged with quantization and kv_cache_dtype
  batchllm bench --workload micro:2000:200:16#1024 --policies batchllm,vllm --quantization none,fp8 \\
      --kv-cache-dtype auto,fp8 --out results/fp8.json

  # a quick smoke test on a CPU
  batchllm bench --model '{cpu_model}' --workload micro:64:16:4 --requests 16 --output-tokens 4 \\
      --policies batchllm,vllm --out /tmp/bench.json

Policies: batchllm, vllm, sglang, simple; NAME@TOKENS sets the token budget, NAME@SEQS/TOKENS also
the request cap; suffix +eager runs without CUDA graphs, +sync without asynchronous scheduling.
Outputs are forced to max_tokens (EOS ignored), so every policy does the same work. Each policy
runs after a warm-up batch of 8 requests (kernel compilation excluded). time/bound: wall time over
the FLOP bound with optimal prefix sharing at the H200 bf16 peak ({bf16_tflops:.0f} TFLOP/s), or for
rows with --quantization fp8 at the H200 FP8 peak ({fp8_tflops:.0f} TFLOP/s): arithmetic only.
time/roofline: wall time over the sum over the run's steps of max(FLOPs / that peak, bytes read /
{bandwidth_tbs:.1f} TB/s, the H200 copy ceiling), the bytes being the weights, the LM head when a row
samples and the KV each step attends (a batchllm group's shared prefix once per step).
time/serial roofline: the same, with each step's linear layers (weights, LM head) and its
attention (KV) each at its own max(FLOPs / peak, bytes / bandwidth), added: the engine runs them
one after the other, so a mixed step's GEMMs cannot hide its decode rows' KV reads.
On a CUDA GPU the --out rows also count the caching allocator's retries and cudaMalloc / cudaFree
calls during the timed run (allocator_retries, device_mallocs, device_frees): each cudaFree, and
each retry (it frees the cache), waits for the device, so a run that counts them had launches that
waited for the GPU.
--out and --markdown are rewritten after every row, so a run that dies keeps what it measured.
"""


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmark several scheduling policies on one model (throughput, saving ratio, time/bound)",
        description=(
            "Generate a workload (or read --input FILE), load the model once, run every policy on it\n"
            "and report for each: wall time, requests/s, input and output tokens/s, processed prefill\n"
            "tokens and saving ratio, mean tokens per step, valleys, peak KV memory and time over the\n"
            "FLOP bound and over the roofline. The table is printed; rows go to --out (JSON) and the\n"
            "table to --markdown only when asked for, rewritten after every row.\n"
            f"Default model: {DEFAULT_GPU_MODEL} (random weights) on a CUDA GPU; on a machine without\n"
            f"CUDA pass --model (e.g. '{CPU_SMOKE_MODEL}' or a small .gguf file)."
        ),
        epilog=EPILOG.format(cpu_model=CPU_SMOKE_MODEL, bf16_tflops=H200_BF16_PEAK_FLOPS / 1e12,
                             fp8_tflops=H200_FP8_PEAK_FLOPS / 1e12,
                             bandwidth_tbs=H200_COPY_BANDWIDTH_BYTES_PER_S / 1e12),
    )
    parser.add_argument("--model", default=None,
                        help=f"random:PRESET (random:llama-3.1-8b, random:qwen2.5-7b, random:qwen2.5-14b, "
                             f"random:tiny?vocab_size=32000 ...), a .gguf file or a HF model directory "
                             f"(default: {DEFAULT_GPU_MODEL}, CUDA only)")
    parser.add_argument("--workload", action="append", default=None, metavar="SPEC",
                        help="micro:P:D:SD (prefix P tokens, D distinct, sharing degree SD), industrial, or "
                             "uniform:ISL:OSL (random prompts of ISL tokens, OSL output tokens each; 128:128 runs "
                             "30000 requests, 2048:128 and 1000:1000 3000 each, as TensorRT-LLM's table), "
                             "optionally #N requests (repeatable; default micro:2000:200:16 unless --input)")
    parser.add_argument("--input", action="append", default=[], metavar="FILE",
                        help="also (or only) benchmark the requests of this OpenAI-Batch JSONL file (repeatable); "
                             "each line's max_tokens is its forced output length; bad lines are reported and skipped")
    parser.add_argument("--requests", type=int, default=512, help="requests per generated workload (default 512)")
    parser.add_argument("--output-tokens", type=int, default=100,
                        help="output tokens per generated request (default 100); also for an --input chat line without "
                             "max_tokens (a completion line without it gets 16, as in `batchllm run`)")
    parser.add_argument("--policies", default="batchllm,vllm,sglang",
                        help="comma list (default batchllm,vllm,sglang); NAME@TOKENS or NAME@SEQS/TOKENS sets the "
                             "budget; suffix +eager (no CUDA graphs) or +sync (no asynchronous scheduling)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                        help=f"token budget per step (default {DEFAULT_MAX_NUM_BATCHED_TOKENS})")
    parser.add_argument("--attention-backend", default="auto",
                        choices=["auto", "reference", "torch", "triton", "fused", "xqa"],
                        help="as batchllm run's (xqa: FlashInfer's XQA kernel for the decode rows of requests that "
                             "share no prefix and its FA3 kernel for prompt attention, in FP8 products; FP8 KV caches "
                             "on Hopper GPUs)")
    parser.add_argument("--kv-cache-tokens", type=int, default=None,
                        help="KV cache capacity in tokens (default: what --gpu-memory-utilization leaves; "
                             "32768 on CPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION,
                        help="share of the GPU's memory the engine may fill: weights, activations and the KV "
                             f"cache, which takes what is left (default {DEFAULT_GPU_MEMORY_UTILIZATION})")
    parser.add_argument("--quantization", default=NO_QUANTIZATION, metavar="{" + ",".join(QUANTIZATION_CHOICES) + "}",
                        help="fp8: the decoder's linear layers run FP8 (e4m3) GEMMs, weights scaled per output "
                             "channel, activations per token; the embedding, LM head and norms stay bf16. "
                             "none (default): no quantization. A comma list (none,fp8) runs each in this one "
                             "invocation, the model loaded once per value, and tags every row with it. FP8 "
                             "needs an NVIDIA GPU of compute capability 8.9+ (Ada or Hopper)")
    parser.add_argument("--kv-cache-dtype", default="auto", metavar="{" + ",".join(KV_CACHE_DTYPE_CHOICES) + "}",
                        help="auto (default): the KV cache in the model dtype; fp8: an e4m3 KV cache (twice "
                             "the tokens in the same memory; needs an NVIDIA GPU of compute capability 8.9+, "
                             "Ada or Hopper). A comma list (auto,fp8) runs each; with a --quantization list, "
                             "every combination runs")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                        help="auto: float32 on CPU, bfloat16 on GPU")
    parser.add_argument("--out", default=None, metavar="FILE.json",
                        help="write the raw rows as JSON here (default: write nothing)")
    parser.add_argument("--markdown", default=None, metavar="FILE.md",
                        help="write the Markdown table here (default: --out with .md; nothing without --out)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace-dir", default=None, metavar="DIR",
                        help="write each run's step trace (batchllm plot input) and one timeline PNG per "
                             "workload with every policy's panel into DIR")
    parser.add_argument("--git-commit", default=None,
                        help="commit id to record (default: $BATCHLLM_GIT_COMMIT, else the checkout's short "
                             "hash, with -dirty when tracked files were changed)")
    parser.add_argument("--no-warm-pass", dest="warm_pass", action="store_false",
                        help="skip the untimed pass of the first policy over each workload (by default it "
                             "runs before the workload's timed policies, so one-time costs such as the CUDA "
                             "graph captures of its shapes do not fall on its first timed policy)")
    parser.add_argument("--hf-peer", default="0", metavar="B[,B...]",
                        help="also time HF transformers `generate` (static batches, sdpa, its own random weights) "
                             "on the first workload at each of these batch sizes (e.g. 64,128), after every engine "
                             "row with the engines freed; requests of equal prompt length are batched together "
                             "(no padding), each size is warmed up on its batch shapes and timed over whole "
                             "batches covering the first --hf-peer-requests requests; the fastest size's time, "
                             "scaled to the whole workload, is the row, every size's under \"sweep\"; when the "
                             "largest size that fit is the fastest and a larger one ran out of memory, the sizes "
                             "between them are bisected (default 0: no peer)")
    parser.add_argument("--hf-peer-requests", type=int, default=None, metavar="N",
                        help="requests the HF peer's timed batches cover at least (default: the largest "
                             "--hf-peer batch size)")
    parser.set_defaults(func=bench_command)


def resolve_model(args) -> str | None:
    """The model to run, or None after printing why not (no CUDA for the 8B default)."""
    if args.model:
        if args.model.startswith("random:") and not args.model.startswith("random:tiny") and not _cuda(args.device):
            print(f"warning: {args.model} on CPU is very slow (hours for the default workload); "
                  f"for a smoke test use --model '{CPU_SMOKE_MODEL}'", file=sys.stderr)
        return args.model
    if _cuda(args.device):
        return DEFAULT_GPU_MODEL
    print(f"error: no CUDA GPU here, and the default model {DEFAULT_GPU_MODEL} would take hours on a CPU "
          f"(fix: pass --model, e.g. --model '{CPU_SMOKE_MODEL}' --workload micro:64:16:4 --requests 16 "
          f"--output-tokens 4, or a small .gguf file / HF model directory{_default_gguf_hint()})", file=sys.stderr)
    return None


def _default_gguf_hint() -> str:
    from batchllm.models.default_model import default_model_path

    try:
        return f" such as --model {default_model_path()}"
    except Exception:  # noqa: BLE001 -- only a hint
        return ""


def _cuda(device: str) -> bool:
    if device not in ("auto",) and not device.startswith("cuda"):
        return False
    import torch

    return torch.cuda.is_available()


def options_from_args(args, model: str):
    from batchllm.perf.engine_variants import parse_variants
    from batchllm.perf.hf_batches import parse_batch_sizes
    from batchllm.perf.runner import BenchOptions

    return BenchOptions(model=model, variants=parse_variants(args.quantization, args.kv_cache_dtype),
                        workloads=list(args.workload or []), inputs=list(args.input),
                        requests=args.requests, output_tokens=args.output_tokens, policies=args.policies,
                        max_num_batched_tokens=args.max_num_batched_tokens, attention_backend=args.attention_backend,
                        kv_cache_tokens=args.kv_cache_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
                        device=args.device, dtype=args.dtype, seed=args.seed,
                        trace_dir=args.trace_dir, git_commit=args.git_commit,
                        hf_peer=parse_batch_sizes(args.hf_peer), hf_peer_requests=args.hf_peer_requests,
                        warm_pass=args.warm_pass)


def output_files(args):
    """The files to write (result_files.ResultFiles): none unless --out or --markdown."""
    from batchllm.perf.result_files import ResultFiles

    markdown = args.markdown or (os.path.splitext(args.out)[0] + ".md" if args.out else None)
    return ResultFiles(json_path=args.out, markdown_path=markdown)


def fp8_problem(options) -> str | None:
    """Why the FP8 variants of options (BenchOptions) cannot run on its device, or None."""
    if not any(variant.uses_fp8 for variant in options.variants):
        return None
    from batchllm.models.fp8_linear import fp8_unsupported_reason
    from batchllm.engine.loading import resolve_device

    reason = fp8_unsupported_reason(resolve_device(options.device))
    if reason is None:
        return None
    return f"{reason} (fix: run on such a GPU, or leave out --quantization fp8 / --kv-cache-dtype fp8)"


def _load(options, variant):
    from batchllm.perf.runner import load_llm

    print(f"loading model {options.model} ({variant.label}) ...", file=sys.stderr)
    return load_llm(options, variant)


def bench_command(args) -> int:
    """Exit codes: 0 every row measured, 1 some policy or engine variant failed (its row has "error",
    or the result lists it under "load_errors"), 2 nothing ran."""
    from batchllm.perf.engine_variants import parse_variants
    from batchllm.perf.hf_batches import parse_batch_sizes
    from batchllm.perf.policies import parse_policies
    from batchllm.cli.run import _input_problem

    try:
        parse_policies(args.policies)
        parse_variants(args.quantization, args.kv_cache_dtype)
        parse_batch_sizes(args.hf_peer)
        if args.hf_peer_requests is not None and args.hf_peer_requests < 1:
            raise ValueError("--hf-peer-requests must be at least 1")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for path in args.input:
        problem = _input_problem(path)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    if args.requests < 1 or args.output_tokens < 1:
        print("error: --requests and --output-tokens must be at least 1", file=sys.stderr)
        return 2
    model = resolve_model(args)
    if model is None:
        return 2
    options = options_from_args(args, model)
    from batchllm.perf.markdown import render_markdown
    from batchllm.perf.runner import check_engines, run_variants

    try:
        check_engines(options)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    problem = fp8_problem(options)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    files = output_files(args)
    try:
        result = run_variants(options, load=_load, log=lambda text: print(text, flush=True), on_update=files.write)
    except SystemExit as error:  # a bad workload spec or a vocabulary too small for it
        if isinstance(error.code, int):
            raise
        print(f"error: {error.code}", file=sys.stderr)
        return 2
    if not result["rows"]:
        if result.get("load_errors"):
            print(f"error: {result['load_errors'][0]['error']}", file=sys.stderr)  # it names its own fix
        else:
            print("error: nothing ran (no request could run)", file=sys.stderr)
        return 2
    files.write(result)
    print()
    print(render_markdown(result), end="")
    if files.paths:
        print("\nwrote " + " and ".join(files.paths))
    failed = result.get("load_errors") or any("error" in row for row in result["rows"])
    return 1 if failed else 0
