"""What n > 1 costs against writing each prompt n times: the same random prompts run once as
`--requests` lines of n samples each, and once as n x `--requests` one-sample lines (each prompt
written n times, which the planner groups). Both sample at temperature 1 with EOS ignored, so
they generate the same number of tokens; the runs alternate --repeat times after a warm-up of each.
Reported per run: wall seconds, output tokens/s and the prompt tokens the steps processed.

    PYTHONPATH=. python3 benchmarks/n_samples.py --model random:llama-3.1-8b --requests 1024 \\
        --prompt-tokens 512 --output-tokens 64 --n 4 --out n_samples.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from batchllm.sched.config import DEFAULT_MAX_NUM_BATCHED_TOKENS


def run_once(llm, prompts: list[list[int]], n: int, output_tokens: int) -> dict:
    from batchllm.sampling_params import SamplingParams

    params = SamplingParams(n=n, temperature=1.0, max_tokens=output_tokens, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    num_output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    steps = llm.last_run_stats.step_records
    return {"seconds": round(seconds, 3), "output_tokens": num_output_tokens,
            "output_tok_per_s": round(num_output_tokens / seconds, 1), "steps": len(steps),
            "processed_prompt_tokens": sum(s.num_distinct_tokens + s.num_prefix_tokens for s in steps)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:llama-3.1-8b")
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--kv-cache-tokens", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from batchllm.llm import LLM

    llm = LLM(args.model, kv_cache_tokens=args.kv_cache_tokens, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, device=args.device,
              max_num_batched_tokens=args.max_num_batched_tokens)
    vocab_size = llm.engine.arch.vocab_size
    rng = np.random.default_rng(0)
    prompts = rng.integers(10, vocab_size, size=(args.requests, args.prompt_tokens)).tolist()
    written = [p for p in prompts for _ in range(args.n)]
    run_once(llm, prompts[:8], args.n, args.output_tokens)  # warm-up: graphs and kernel compiles
    run_once(llm, written[:8 * args.n], 1, args.output_tokens)
    runs = {"n_samples": [], "lines": []}
    for _ in range(args.repeat):
        runs["n_samples"].append(run_once(llm, prompts, args.n, args.output_tokens))
        runs["lines"].append(run_once(llm, written, 1, args.output_tokens))
        print(json.dumps({kind: r[-1] for kind, r in runs.items()}), flush=True)
    ratio = statistics.median(r["seconds"] for r in runs["n_samples"]) / statistics.median(
        r["seconds"] for r in runs["lines"])
    result = {"args": vars(args), "runs": runs, "time_ratio_n_over_lines": round(ratio, 3),
              "prompt_tokens_of_the_prompts": args.requests * args.prompt_tokens}
    print(f"n={args.n} over {args.n}x lines, median time ratio {ratio:.3f}; prompt tokens processed "
          f"{runs['n_samples'][0]['processed_prompt_tokens']} (n samples) and {runs['lines'][0]['processed_prompt_tokens']} "
          f"(lines) for {args.requests * args.prompt_tokens} prompt tokens")
    if args.out:
        with open(args.out, "w") as file:
            json.dump(result, file, indent=1)
    return result


if __name__ == "__main__":
    main()
