"""CPU side by side: batchllm vs HF transformers `generate` on the same batch (default model).

    python benchmarks/cpu_vs_hf.py [--input examples/batch.jsonl] [--chat-requests 40] [--repeat 3]
                                   [--threads 1] [--hf-one-at-a-time] [--out benchmarks/results/cpu_vs_hf.json]

Every request generates exactly its max_tokens (EOS ignored on both sides) with greedy decoding,
so both produce the same number of tokens. HF runs one left-padded static batch of all requests
(and, with --hf-one-at-a-time, one request at a time). Both run in one process, alternating, each
--repeat times, so load on a shared machine hits both alike; the spread (min / median / max) is
reported.

--chat-requests N builds N chat requests from the input's chat lines: line i % C (C chat lines)
with its question numbered, so the requests share the input's documents (examples/batch.jsonl:
two documents, N / 2 questions on each) but no two prompts are equal.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from dataclasses import replace


def _requests(path: str, num_chat_requests: int) -> list:
    from batchllm.io.batch_input import BatchRequest, read_batch_file

    requests = [r for r in read_batch_file(path) if isinstance(r, BatchRequest)]
    if not num_chat_requests:
        return requests
    chats = [r for r in requests if r.messages is not None]
    if not chats:
        raise SystemExit(f"{path} has no chat lines to build --chat-requests from")
    built = []
    for i in range(num_chat_requests):
        base = chats[i % len(chats)]
        *context, question = base.messages
        numbered = {**question, "content": f"Question {i // len(chats) + 1}: {question['content']}"}
        built.append(replace(base, custom_id=f"{base.custom_id}-{i}", messages=(*context, numbered)))
    return built


def _spread(values: list[float]) -> dict:
    return {"min": round(min(values), 2), "median": round(statistics.median(values), 2), "max": round(max(values), 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", default="examples/batch.jsonl")
    parser.add_argument("--chat-requests", type=int, default=0, help="build N chat requests (0: the input as is)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--hf-one-at-a-time", action="store_true", help="also time HF on one request at a time")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads for both sides (default: torch's choice); on a machine shared "
                             "with other work, 1 keeps OpenMP barriers from stalling on descheduled threads")
    parser.add_argument("--out", default="benchmarks/results/cpu_vs_hf.json")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from batchllm import LLM, SamplingParams
    from batchllm.job.batch_job import tokenize_request
    from batchllm.models.default_model import default_model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(dtype="float32", device="cpu")
    requests = _requests(args.input, args.chat_requests)
    prompts = [tokenize_request(llm.engine, r) for r in requests]
    max_tokens = [r.sampling.max_tokens or 64 for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    num_output = sum(max_tokens)
    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run_batchllm() -> None:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert sum(len(o.outputs[0].token_ids) for o in outputs) == num_output

    def run_hf_static_batch() -> None:
        # The static batch generates max(max_tokens) for every row (equal here for chat requests).
        hf.generate(input_ids, attention_mask=mask, max_new_tokens=max(max_tokens), min_new_tokens=max(max_tokens),
                    do_sample=False, pad_token_id=0)

    def run_hf_one_at_a_time() -> None:
        for ids, m in zip(prompts, max_tokens):
            x = torch.tensor([ids])
            hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=m, min_new_tokens=m, do_sample=False,
                        pad_token_id=0)

    runs = {"batchllm": run_batchllm, "hf_generate_static_batch": run_hf_static_batch}
    if args.hf_one_at_a_time:
        runs["hf_generate_batch1"] = run_hf_one_at_a_time
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    with torch.no_grad():
        for _ in range(args.repeat):
            for name, run in runs.items():
                started = time.perf_counter()
                run()
                seconds[name].append(time.perf_counter() - started)
                print(json.dumps({"impl": name, "seconds": round(seconds[name][-1], 2)}), flush=True)
    rows = []
    for name, values in seconds.items():
        median = statistics.median(values)
        rows.append({"impl": name, "seconds": _spread(values), "req_per_s": round(len(prompts) / median, 3),
                     "output_tok_per_s": round(num_output / median, 1)})
        print(json.dumps(rows[-1]))
    ratios = [hf_s / ours for ours, hf_s in zip(seconds["batchllm"], seconds["hf_generate_static_batch"])]
    print(json.dumps({"speedup_vs_hf_static_batch": _spread(ratios)}))
    result = {"device": "cpu (2 cores)", "threads": torch.get_num_threads(), "date": datetime.date.today().isoformat(), "requests": len(prompts),
              "prompt_tokens": sum(len(p) for p in prompts), "output_tokens": num_output, "repeat": args.repeat,
              "rows": rows, "speedup_vs_hf_static_batch": _spread(ratios)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
