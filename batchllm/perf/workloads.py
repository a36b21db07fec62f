"""Synthetic workloads from the paper (BatchLLM 6.1/6.2), as token ids or text, written as JSONL.

- micro P/D/sd: every prompt = a shared prefix of P tokens + D distinct tokens; sd prompts
  share each prefix; 100 generated tokens; requests shuffled (6.1).
- uniform ISL/OSL: random prompts of ISL tokens, OSL generated tokens each, nothing shared (the
  shape of TensorRT-LLM's throughput table: its prepare_dataset token-norm-dist with both
  standard deviations 0).
- industrial-like: mean sharing degree ~3, mean prefix ~1570 tokens, mean distinct ~30 tokens,
  skewed (geometric sharing degree, lognormal lengths), 8000 requests (6.2.2). Prefixes start
  with one of a few instruction templates, so the prefix tree has more than one level and
  the naive first-level grouping is visibly worse than the optimum (Fig. 4).

Torch-free. `python -m batchllm.perf.workloads --help` writes files.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import TextIO

import numpy as np

DEFAULT_LOW_TOKEN_ID = 1000  # keep clear of special tokens of real vocabularies
DEFAULT_VOCAB_SIZE = 32000


@dataclass(frozen=True)
class Workload:
    """A batch of requests: token ids per request plus its output length."""

    name: str
    custom_ids: tuple[str, ...]
    prompts: tuple[np.ndarray, ...]  # int32 token ids per request
    max_tokens: tuple[int, ...]  # output tokens per request

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        return int(sum(p.size for p in self.prompts))


def _distinct_first_tokens(rng: np.random.Generator, count: int, low: int, high: int) -> np.ndarray:
    """count different token ids (with replacement only if the range is too small)."""
    replace = count > high - low
    return (low + rng.choice(high - low, size=count, replace=replace)).astype(np.int32)


def _assemble(name, rng, prefixes, distincts, output_num_tokens) -> Workload:
    prompts = [np.concatenate((p, d)) for p, d in zip(prefixes, distincts)]
    prompts = [prompts[i] for i in rng.permutation(len(prompts))]
    custom_ids = tuple(f"request-{i}" for i in range(len(prompts)))
    return Workload(name, custom_ids, tuple(prompts), (output_num_tokens,) * len(prompts))


def micro_workload(
    prefix_num_tokens: int,
    distinct_num_tokens: int,
    sharing_degree: int,
    num_requests: int = 6400,  # BatchLLM Fig. 6 uses 6400 requests
    output_num_tokens: int = 100,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    low_token_id: int = DEFAULT_LOW_TOKEN_ID,
    seed: int = 0,
) -> Workload:
    """Micro set P/D/sd. Prefixes differ in their first token and the distinct parts of one
    group differ in their first token, so each group shares exactly P tokens: the saving
    ratio is the upper bound (sd - 1) * P / (sd * (P + D)) (85.2% for 2000/200 sd16)."""
    if prefix_num_tokens < 0 or distinct_num_tokens < 1 or sharing_degree < 1 or num_requests < 0:
        raise ValueError("need prefix >= 0, distinct >= 1, sharing degree >= 1, requests >= 0")
    rng = np.random.default_rng(seed)
    num_groups = -(-num_requests // sharing_degree)
    prefixes, distincts = [], []
    group_first = _distinct_first_tokens(rng, num_groups, low_token_id, vocab_size)
    for group in range(num_groups):
        prefix = rng.integers(low_token_id, vocab_size, prefix_num_tokens, dtype=np.int32)
        if prefix_num_tokens:
            prefix[0] = group_first[group]
        size = min(sharing_degree, num_requests - group * sharing_degree)
        member_first = _distinct_first_tokens(rng, size, low_token_id, vocab_size)
        for member in range(size):
            distinct = rng.integers(low_token_id, vocab_size, distinct_num_tokens, dtype=np.int32)
            distinct[0] = member_first[member]
            prefixes.append(prefix)
            distincts.append(distinct)
    name = f"micro-{prefix_num_tokens}/{distinct_num_tokens}-sd{sharing_degree}"
    return _assemble(name, rng, prefixes, distincts, output_num_tokens)


def uniform_workload(
    input_num_tokens: int,
    output_num_tokens: int,
    num_requests: int,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    low_token_id: int = DEFAULT_LOW_TOKEN_ID,
    seed: int = 0,
) -> Workload:
    """num_requests random prompts of input_num_tokens tokens, output_num_tokens to generate each.
    Prompts begin with different tokens where the vocabulary allows, so that no two share a prefix
    the planner could group."""
    if input_num_tokens < 1 or output_num_tokens < 1 or num_requests < 0:
        raise ValueError("need input and output lengths >= 1 and requests >= 0")
    rng = np.random.default_rng(seed)
    prompts = rng.integers(low_token_id, vocab_size, (num_requests, input_num_tokens), dtype=np.int32)
    prompts[:, 0] = _distinct_first_tokens(rng, num_requests, low_token_id, vocab_size)
    name = f"uniform-{input_num_tokens}/{output_num_tokens}"
    custom_ids = tuple(f"request-{i}" for i in range(num_requests))
    return Workload(name, custom_ids, tuple(prompts), (output_num_tokens,) * num_requests)


def _lognormal_lengths(rng, mean: float, sigma: float, count: int, minimum: int) -> np.ndarray:
    """Skewed positive lengths whose mean is ~mean (lognormal: mu = ln(mean) - sigma^2 / 2)."""
    mu = np.log(mean) - sigma * sigma / 2
    return np.maximum(minimum, np.rint(rng.lognormal(mu, sigma, count))).astype(np.int64)


def industrial_workload(
    num_requests: int = 8000,  # BatchLLM 6.2.2 samples 8000 queries
    mean_sharing_degree: float = 3.0,
    mean_prefix_num_tokens: float = 1570.0,
    mean_distinct_num_tokens: float = 30.0,
    num_instruction_templates: int = 8,
    instruction_num_tokens: int = 32,
    length_sigma: float = 0.8,
    output_num_tokens: int = 100,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    low_token_id: int = DEFAULT_LOW_TOKEN_ID,
    seed: int = 0,
) -> Workload:
    """Industrial-like set (6.2.2): prefix = instruction template + document; a document is
    asked sd questions (geometric sd with the given mean); lengths lognormal (skewed)."""
    if num_requests < 0 or mean_sharing_degree < 1:
        raise ValueError("need requests >= 0 and mean sharing degree >= 1")
    rng = np.random.default_rng(seed)
    templates = [
        rng.integers(low_token_id, vocab_size, instruction_num_tokens, dtype=np.int32)
        for _ in range(max(1, num_instruction_templates))
    ]
    if instruction_num_tokens:
        firsts = _distinct_first_tokens(rng, len(templates), low_token_id, vocab_size)
        for template, first in zip(templates, firsts):
            template[0] = first
    document_mean = max(1.0, mean_prefix_num_tokens - instruction_num_tokens)
    # Geometric on {1, 2, ...} with mean 1/p.
    group_sizes = rng.geometric(1.0 / mean_sharing_degree, size=num_requests + 1)
    bounds = np.cumsum(group_sizes)
    num_groups = int(np.searchsorted(bounds, num_requests)) + 1
    group_sizes = group_sizes[:num_groups].copy()
    group_sizes[-1] -= int(bounds[num_groups - 1]) - num_requests
    document_lengths = _lognormal_lengths(rng, document_mean, length_sigma, num_groups, 1)
    distinct_lengths = _lognormal_lengths(rng, mean_distinct_num_tokens, length_sigma, num_requests, 1)
    prefixes, distincts = [], []
    for group, size in enumerate(group_sizes.tolist()):
        template = templates[int(rng.integers(len(templates)))]
        document = rng.integers(low_token_id, vocab_size, int(document_lengths[group]), dtype=np.int32)
        prefix = np.concatenate((template, document))
        for _ in range(size):
            prefixes.append(prefix)
            distinct_num_tokens = int(distinct_lengths[len(distincts)])
            distincts.append(rng.integers(low_token_id, vocab_size, distinct_num_tokens, dtype=np.int32))
    return _assemble("industrial-like", rng, prefixes, distincts, output_num_tokens)


def token_ids_to_text(token_ids: np.ndarray) -> str:
    """A deterministic text stand-in for token ids: one word per id ("w1234 w77 ...")."""
    return " ".join(f"w{t}" for t in token_ids.tolist())


def write_jsonl(workload: Workload, stream: TextIO, text: bool = False) -> int:
    """Short-form request lines: {"custom_id", "prompt_token_ids" | "prompt", "max_tokens"}."""
    for custom_id, prompt, max_tokens in zip(workload.custom_ids, workload.prompts, workload.max_tokens):
        key, value = ("prompt", token_ids_to_text(prompt)) if text else ("prompt_token_ids", prompt.tolist())
        record = {"custom_id": custom_id, key: value, "max_tokens": max_tokens}
        stream.write(json.dumps(record, separators=(",", ":")) + "\n")
    return workload.num_requests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchllm.perf.workloads", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="kind", required=True)
    micro = sub.add_parser("micro", help="micro set P/D/sd (BatchLLM 6.1)")
    micro.add_argument("--prefix", type=int, required=True, help="shared prefix tokens P")
    micro.add_argument("--distinct", type=int, required=True, help="distinct tokens D")
    micro.add_argument("--sd", type=int, required=True, help="sharing degree")
    micro.add_argument("-n", "--num-requests", type=int, default=6400)
    industrial = sub.add_parser("industrial", help="industrial-like set (BatchLLM 6.2.2)")
    industrial.add_argument("-n", "--num-requests", type=int, default=8000)
    uniform = sub.add_parser("uniform", help="random prompts of ISL tokens, OSL output tokens each")
    uniform.add_argument("--isl", type=int, required=True, help="input tokens per request")
    uniform.add_argument("-n", "--num-requests", type=int, default=3000)
    for p in (micro, industrial, uniform):
        p.add_argument("-o", "--output", required=True, help="JSONL path ('-' = stdout)")
        p.add_argument("--max-tokens", type=int, default=100, help="output tokens per request (uniform: OSL)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--text", action="store_true", help="write text prompts instead of token ids")
    args = parser.parse_args(argv)
    if args.kind == "micro":
        workload = micro_workload(args.prefix, args.distinct, args.sd, args.num_requests,
                                  output_num_tokens=args.max_tokens, seed=args.seed)
    elif args.kind == "uniform":
        workload = uniform_workload(args.isl, args.max_tokens, args.num_requests, seed=args.seed)
    else:
        workload = industrial_workload(args.num_requests, output_num_tokens=args.max_tokens, seed=args.seed)
    if args.output == "-":
        write_jsonl(workload, sys.stdout, text=args.text)
    else:
        with open(args.output, "w", encoding="utf-8") as stream:
            write_jsonl(workload, stream, text=args.text)
    print(f"{workload.name}: {workload.num_requests} requests, {workload.num_prompt_tokens} prompt tokens",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
