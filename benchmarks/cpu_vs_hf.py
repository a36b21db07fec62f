"""CPU side by side: batchllm vs HF transformers `generate` on the same batch (default model).

    python benchmarks/cpu_vs_hf.py [--input examples/batch.jsonl] [--out benchmarks/results/cpu_vs_hf.json]

Every request generates exactly its max_tokens (EOS ignored on both sides) with greedy decoding,
so both produce the same number of tokens. HF runs (a) one request at a time and (b) one
left-padded static batch of all requests.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", default="examples/batch.jsonl")
    parser.add_argument("--out", default="benchmarks/results/cpu_vs_hf.json")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from batchllm import LLM, SamplingParams
    from batchllm.batch_job import tokenize_request
    from batchllm.io.batch_input import BatchRequest, read_batch_file
    from batchllm.models.loader import default_model_path

    llm = LLM(dtype="float32", device="cpu")
    requests = [r for r in read_batch_file(args.input) if isinstance(r, BatchRequest)]
    prompts = [tokenize_request(llm.engine, r) for r in requests]
    max_tokens = [r.sampling.max_tokens or 64 for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    num_output = sum(max_tokens)
    rows = []

    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == num_output
    rows.append({"impl": "batchllm", "seconds": round(seconds, 2)})

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    started = time.perf_counter()
    with torch.no_grad():
        for ids, m in zip(prompts, max_tokens):
            x = torch.tensor([ids])
            hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=m, min_new_tokens=m, do_sample=False,
                        pad_token_id=0)
    rows.append({"impl": "hf_generate_batch1", "seconds": round(time.perf_counter() - started, 2)})

    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    started = time.perf_counter()
    with torch.no_grad():
        hf.generate(input_ids, attention_mask=mask, max_new_tokens=max(max_tokens), min_new_tokens=max(max_tokens),
                    do_sample=False, pad_token_id=0)
    # The static batch generates max(max_tokens) for every row; count only the tokens asked for.
    rows.append({"impl": "hf_generate_static_batch", "seconds": round(time.perf_counter() - started, 2)})

    for row in rows:
        row["req_per_s"] = round(len(prompts) / row["seconds"], 3)
        row["output_tok_per_s"] = round(num_output / row["seconds"], 1)
        print(json.dumps(row))
    result = {"device": "cpu (2 cores)", "date": datetime.date.today().isoformat(), "requests": len(prompts),
              "prompt_tokens": sum(len(p) for p in prompts), "output_tokens": num_output, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
