"""`batchllm simulate`: run a scheduling policy over a batch with a cost model, no model, no GPU.
Prompts are tokenized as cli/prompt_tokens.py says."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from batchllm.cli.prompt_tokens import add_model_argument
from batchllm.sched.config import DEFAULT_MAX_NUM_BATCHED_TOKENS

DEFAULT_KV_CACHE_TOKENS = 1_000_000  # ~ Llama-3.1-8B on an H200 after weights (128 KiB/token)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="simulate a scheduling policy on a batch (steps, tokens per step, saving ratio)",
        description=(
            "Drive the batchllm / vllm / sglang / simple scheduler over a batch with fake sampling\n"
            "(every request runs to its max_tokens) and a linear cost model. Reports steps, mean\n"
            "tokens per step, valleys (steps under half the token budget), achieved prefill saving\n"
            "ratio, peak KV memory and preemptions. Text and chat lines are tokenized with --model\n"
            "(default: the model `batchllm run` uses); prompt_token_ids lines need no model."
        ),
    )
    parser.add_argument("input", metavar="INPUT.jsonl", help="request lines (+ max_tokens)")
    add_model_argument(parser)
    parser.add_argument("--policy", default="batchllm", choices=("batchllm", "vllm", "sglang", "simple"))
    parser.add_argument("--kv-cache-tokens", type=int, default=DEFAULT_KV_CACHE_TOKENS,
                        help=f"KV cache size in tokens (default {DEFAULT_KV_CACHE_TOKENS})")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default 16)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                        help=f"token budget per step, N_chunk (default {DEFAULT_MAX_NUM_BATCHED_TOKENS})")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="request cap per step (vllm default 256; batchllm ignores it)")
    parser.add_argument("--kv-memory-threshold", type=float, default=None, help="M_threshold as a fraction of the KV cache")
    parser.add_argument("--no-prefix-caching", action="store_true", help="vllm/sglang: disable the LRU prefix cache")
    parser.add_argument("--check", action="store_true", help="also verify the chunk stream against a fake KV store (slow)")
    parser.add_argument("--trace", metavar="OUT.json", default=None, help="write per-step records for `batchllm plot`")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(func=simulate_command)


def read_sim_requests(path: str, model: str | None = None) -> list:
    """Requests of every line (text tokenized with model's tokenizer; None: the default model);
    raises ValueError naming the first bad line."""
    from batchllm.cli.prompt_tokens import read_prompts
    from batchllm.io.batch_input import BatchError
    from batchllm.sched.simulator import SimRequest

    requests = []
    for item, token_ids in read_prompts(path, model, where=f"{path} "):
        if isinstance(item, BatchError):
            raise ValueError(f"{path} line {item.line_number}: {item.code}: {item.message}")
        if not token_ids:
            raise ValueError(f"{path} line {item.line_number}: the prompt encodes to 0 tokens")
        max_tokens = item.sampling.max_tokens
        if max_tokens is None:
            raise ValueError(f"{path} line {item.line_number}: simulate needs max_tokens")
        requests += [SimRequest(tuple(token_ids), int(max_tokens))] * item.sampling.n  # a line's n samples, as `run`
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests


def simulate_command(args: argparse.Namespace) -> int:
    from batchllm.sched.config import SchedulerConfig
    from batchllm.sched.simulator import simulate
    from batchllm.sched.trace import write_trace

    try:
        requests = read_sim_requests(args.input, args.model)
        config = SchedulerConfig(
            policy=args.policy,
            num_kv_blocks=max(1, args.kv_cache_tokens // args.block_size),
            block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            kv_memory_threshold=args.kv_memory_threshold,
            enable_prefix_caching=not args.no_prefix_caching,
        )
        result, trace, _ = simulate(requests, config, trace_label=args.input if args.trace else None, check=args.check)
    except (OSError, ValueError) as error:
        print(f"batchllm simulate: error: {error}", file=sys.stderr)
        return 2
    if trace is not None:
        write_trace(trace, args.trace)
    if args.json:
        print(json.dumps(asdict(result)))
        return 0
    for key, value in asdict(result).items():
        print(f"{key:28s} {value:.4f}" if isinstance(value, float) else f"{key:28s} {value}")
    return 0
