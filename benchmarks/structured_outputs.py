"""What structured outputs cost: output tokens/s of one batch with and without a JSON schema on
every request (engine), and the host's grammar work per constrained row and step (matcher).

engine: the same requests (a generated workload, greedy or sampled) run unconstrained and with a
JSON schema that no answer completes within --output-tokens (an array of at least 1000 items),
so both runs generate exactly the same number of tokens in the same steps; the ratio of their
output tokens/s is the cost of the masks. A model without a tokenizer (random: presets) compiles
over a synthetic byte-level vocabulary of its size (batchllm/structured/synthetic_vocabulary.py);
--tokenizer DIR compiles over a HF tokenizer's vocabulary instead. A warm-up batch of 8 requests
of each kind runs first (CUDA graphs, kernel compiles, the schema's compile).

    PYTHONPATH=. python3 benchmarks/structured_outputs.py engine --model random:llama-3.1-8b \\
        --workload micro:1000:100:16 --requests 1024 --output-tokens 256 --out structured.json

matcher: --rows matchers of the same schema, each fed random allowed tokens for --steps steps:
microseconds per row of filling the bitmask (xgrammar's threads) and of accepting a token.

    PYTHONPATH=. python3 benchmarks/structured_outputs.py matcher --vocab-size 128256 --rows 1024
"""

from __future__ import annotations

import argparse
import importlib.metadata
import dataclasses
import time

from batchllm.perf.result_files import report_result
from batchllm.sched.config import DEFAULT_MAX_NUM_BATCHED_TOKENS

# Objects of a few typed fields in an array no answer finishes within the benchmark's tokens.
BENCH_SCHEMA = {"type": "object", "properties": {"records": {"type": "array", "minItems": 1000, "items": {
    "type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "kind": {"enum": ["person", "place", "organisation"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1}, "tags": {"type": "array", "maxItems": 3,
                                                                          "items": {"type": "string", "maxLength": 12}}},
    "required": ["name", "kind", "score", "tags"]}}}, "required": ["records"]}


def grammar_vocabulary(engine, tokenizer_dir: str | None):
    """The vocabulary to compile over: --tokenizer's, the engine's tokenizer's, or synthetic."""
    from batchllm.models.tokenizer import load_tokenizer
    from batchllm.structured.synthetic_vocabulary import synthetic_vocabulary
    from batchllm.structured.vocabulary import GrammarVocabulary

    tokenizer = load_tokenizer({"kind": "hf_dir", "path": tokenizer_dir}) if tokenizer_dir else engine.tokenizer
    if tokenizer is None:
        return synthetic_vocabulary(engine.arch.vocab_size, engine.eos_token_ids)
    vocabulary = tokenizer.vocabulary
    return GrammarVocabulary.from_token_bytes(vocabulary.token_bytes, vocabulary.skipped_ids, engine.arch.vocab_size,
                                              engine.eos_token_ids)


def constrained(requests: list, temperature: float) -> tuple[list, list]:
    """(unconstrained, constrained) copies of the requests, at temperature, seeded by id."""
    from batchllm.sampling_params import StructuredOutputsParams

    spec = StructuredOutputsParams(json=BENCH_SCHEMA)
    free, held = [], []
    for request in requests:
        params = dataclasses.replace(request.params, temperature=temperature, seed=request.request_id,
                                     ignore_eos=False)
        free.append(dataclasses.replace(request, params=dataclasses.replace(params, ignore_eos=True)))
        held.append(dataclasses.replace(request, params=dataclasses.replace(params, structured_outputs=spec)))
    return free, held


def timed_run(engine, requests: list) -> dict:
    from batchllm.engine.request_state import RunStats

    stats = RunStats()
    finish_reasons: dict[str, int] = {}
    started = time.perf_counter()
    for done in engine.run(requests, stats=stats):
        finish_reasons[done.finish_reason] = finish_reasons.get(done.finish_reason, 0) + 1
    seconds = time.perf_counter() - started
    return {"seconds": round(seconds, 3), "output_tokens": stats.num_output_tokens, "steps": stats.num_steps,
            "output_tokens_per_s": round(stats.num_output_tokens / seconds, 1), "finish_reasons": finish_reasons}


def run_engine(args) -> dict:
    from batchllm.config import engine_config
    from batchllm.engines import build_engine
    from batchllm.perf.workload import make_workload, prepared_requests
    from batchllm.structured.backend import GrammarBackend

    engine = build_engine(engine_config(args.model, device=args.device, dtype=args.dtype,
                                        kv_cache_tokens=args.kv_cache_tokens,
                                        max_num_batched_tokens=args.max_num_batched_tokens))
    engine.grammars = GrammarBackend(grammar_vocabulary(engine, args.tokenizer))
    workload = make_workload(args.workload, args.requests, args.output_tokens, engine.arch.vocab_size, args.seed)
    requests = [dataclasses.replace(r, params=engine.limits.check(r.prompt_token_ids, r.params))
                for r in prepared_requests(workload)]
    free, held = constrained(requests, args.temperature)
    for warm in (free[:8], held[:8]):
        timed_run(engine, warm)
    result = {"model": args.model, "workload": args.workload, "requests": len(requests),
              "output_tokens": args.output_tokens, "temperature": args.temperature,
              "vocabulary": args.tokenizer or ("tokenizer" if engine.tokenizer is not None else "synthetic"),
              "vocab_size": engine.arch.vocab_size}
    for repeat in range(args.repeats):
        result[f"unconstrained_{repeat}"] = timed_run(engine, free)
        result[f"json_schema_{repeat}"] = timed_run(engine, held)
    best = {kind: max(result[f"{kind}_{r}"]["output_tokens_per_s"] for r in range(args.repeats))
            for kind in ("unconstrained", "json_schema")}
    result["ratio"] = round(best["json_schema"] / best["unconstrained"], 3)
    runs = [result[f"{kind}_{r}"] for kind in ("unconstrained", "json_schema") for r in range(args.repeats)]
    if len({run["output_tokens"] for run in runs}) > 1:  # an answer ended early (an error): not the same work
        result["ratio"] = None
    return result


def run_matcher(args) -> dict:
    import numpy as np
    import torch

    from batchllm.ops.transfer import PinnedStaging
    from batchllm.sampling_params import StructuredOutputsParams
    from batchllm.structured.backend import GrammarBackend
    from batchllm.structured.synthetic_vocabulary import synthetic_vocabulary

    backend = GrammarBackend(synthetic_vocabulary(args.vocab_size, [args.vocab_size - 1]))
    spec = StructuredOutputsParams(json=BENCH_SCHEMA)
    states = [backend.grammar_state(spec) for _ in range(args.rows)]
    rng = np.random.default_rng(args.seed)
    staging = PinnedStaging(torch.device("cpu"))
    fill_s = accept_s = 0.0
    for _ in range(args.steps):
        staging.begin_step()
        started = time.perf_counter()
        _, bitmask = backend.filler.fill(states, list(range(args.rows)), args.vocab_size, staging)
        filled = time.perf_counter()
        bits = (bitmask.view(torch.uint8)[:, :, None] >> torch.arange(8, dtype=torch.uint8)) & 1
        allowed = bits.view(args.rows, -1)[:, :args.vocab_size].numpy()
        tokens = [int(rng.choice(np.flatnonzero(row))) for row in allowed]
        chosen = time.perf_counter()
        for state, token in zip(states, tokens):
            state.advance(token, None)
        accept_s += time.perf_counter() - chosen
        fill_s += filled - started
    backend.shutdown()
    per_row = 1e6 / (args.steps * args.rows)
    return {"vocab_size": args.vocab_size, "rows": args.rows, "steps": args.steps,
            "fill_threads": backend.filler.num_threads, "xgrammar": importlib.metadata.version("xgrammar"),
            "fill_us_per_row": round(fill_s * per_row, 2), "accept_us_per_row": round(accept_s * per_row, 2),
            "host_ms_per_step": round(1000 * (fill_s + accept_s) / args.steps, 2)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(dest="mode", required=True)
    engine = modes.add_parser("engine", help="output tokens/s with and without a JSON schema")
    engine.add_argument("--model", default="random:llama-3.1-8b")
    engine.add_argument("--tokenizer", default=None, metavar="DIR", help="compile over this HF tokenizer's vocabulary")
    engine.add_argument("--workload", default="micro:1000:100:16")
    engine.add_argument("--requests", type=int, default=1024)
    engine.add_argument("--output-tokens", type=int, default=256)
    engine.add_argument("--temperature", type=float, default=1.0)
    engine.add_argument("--repeats", type=int, default=2, help="runs of each kind, alternating (the best counts)")
    engine.add_argument("--device", default="auto")
    engine.add_argument("--dtype", default="auto")
    engine.add_argument("--kv-cache-tokens", type=int, default=None)
    engine.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS)
    matcher = modes.add_parser("matcher", help="host microseconds per constrained row")
    matcher.add_argument("--vocab-size", type=int, default=128256)
    matcher.add_argument("--rows", type=int, default=1024)
    matcher.add_argument("--steps", type=int, default=32)
    for mode in (engine, matcher):
        mode.add_argument("--seed", type=int, default=0)
        mode.add_argument("--out", default=None, metavar="FILE.json")
    args = parser.parse_args(argv)
    result = run_engine(args) if args.mode == "engine" else run_matcher(args)
    report_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
