"""End-to-end throughput: several policies in ONE process on the same model, side by side.

    PYTHONPATH=. python benchmarks/e2e.py --model random:llama-3.1-8b --workload micro:2000:200:16 \
        --requests 512 --policies batchllm,vllm,sglang --out benchmarks/results/e2e.json

Outputs are forced to a fixed length (ignore_eos). Each policy runs after a warm-up batch (Triton
compilation excluded). Time / FLOP bound uses the optimal-sharing FLOPs (benchmarks/flop_bound.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from flop_bound import flop_bound_seconds  # noqa: E402


def make_workload(spec: str, num_requests: int, output_tokens: int, vocab_size: int, seed: int):
    from batchllm.workloads import industrial_workload, micro_workload

    kind, *values = spec.split(":")
    if kind == "micro":
        prefix, distinct, degree = (int(v) for v in values)
        return micro_workload(prefix, distinct, degree, num_requests=num_requests, output_num_tokens=output_tokens,
                              vocab_size=vocab_size, seed=seed)
    if kind == "industrial":
        return industrial_workload(num_requests=num_requests, output_num_tokens=output_tokens, vocab_size=vocab_size,
                                   seed=seed)
    raise SystemExit(f"unknown workload {spec!r}: micro:P:D:SD or industrial")


def parse_policy(text: str) -> tuple[str, str, dict, frozenset]:
    """'vllm@1024/16384' -> ('vllm@1024/16384', 'vllm', {max_num_seqs: 1024, max_num_batched_tokens: 16384});
    'batchllm@8192' -> token budget 8192. Suffixes: '+eager' runs without CUDA graphs, '+sync'
    without asynchronous scheduling (one step at a time)."""
    flags = set()
    base = text
    for suffix in ("+eager", "+sync"):
        for _ in range(2):
            if base.endswith(suffix):
                flags.add(suffix[1:])
                base = base.removesuffix(suffix)
    name, _, setting = base.partition("@")
    changes: dict = {"policy": name}
    if setting:
        parts = setting.split("/")
        if len(parts) == 2:
            changes["max_num_seqs"], changes["max_num_batched_tokens"] = int(parts[0]), int(parts[1])
        else:
            changes["max_num_batched_tokens"] = int(parts[0])
    return text, name, changes, frozenset(flags)


def gpu_busy_seconds(step_events) -> float:
    """Sum of the steps' GPU spans (forward + sampling), from CUDA event pairs (after a sync)."""
    return sum(start.elapsed_time(end) for start, end in step_events if end is not None) / 1000.0


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text).strip("-")


def save_trace(directory: str, workload: str, label: str, engine, steps):
    from batchllm.sched.trace import Trace, write_trace

    config = engine.scheduler_config
    trace = Trace(policy=label, max_num_batched_tokens=config.max_num_batched_tokens,
                  num_kv_blocks=config.num_kv_blocks, block_size=config.block_size, label=workload, steps=list(steps))
    os.makedirs(directory, exist_ok=True)
    write_trace(trace, os.path.join(directory, f"trace-{_slug(workload)}-{_slug(label)}.json"))
    return trace


def time_hf_generate(arch, prompts: list[list[int]], output_tokens: int) -> float:
    """HF transformers `generate` on the same architecture (its own random bf16 weights: speed does
    not depend on them), one static batch, greedy, exactly output_tokens new tokens."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=arch.vocab_size, hidden_size=arch.hidden_size,
                         intermediate_size=arch.intermediate_size, num_hidden_layers=arch.num_layers,
                         num_attention_heads=arch.num_heads, num_key_value_heads=arch.num_kv_heads,
                         head_dim=arch.head_dim, rms_norm_eps=arch.rms_norm_eps, rope_theta=arch.rope_theta,
                         max_position_embeddings=arch.max_position_embeddings,
                         tie_word_embeddings=arch.tie_word_embeddings)
    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", torch_dtype=torch.bfloat16)
    model.eval()
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    with torch.inference_mode():
        model.generate(input_ids[:1, :16], attention_mask=mask[:1, :16], max_new_tokens=2, do_sample=False,
                       pad_token_id=0)  # warm-up
        torch.cuda.synchronize()
        started = time.perf_counter()
        model.generate(input_ids, attention_mask=mask, max_new_tokens=output_tokens, min_new_tokens=output_tokens,
                       do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    del model
    torch.cuda.empty_cache()
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:llama-3.1-8b")
    parser.add_argument("--workload", action="append", default=None,
                        help="micro:P:D:SD or industrial, optionally #N requests (repeatable; "
                             "default micro:2000:200:16)")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=100)
    parser.add_argument("--policies", default="batchllm,vllm,sglang",
                        help="comma list; NAME@TOKENS or NAME@SEQS/TOKENS sets the budget; "
                             "suffix +eager (no CUDA graphs) or +sync (no asynchronous scheduling)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--kv-cache-tokens", type=int, default=None)
    parser.add_argument("--out", default="benchmarks/results/e2e.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace-dir", default=None, metavar="DIR",
                        help="write each run's step trace (batchllm plot input) and one timeline PNG per "
                             "workload with every policy's panel into DIR")
    parser.add_argument("--git-commit", default=None, help="commit id to record (when .git is absent)")
    parser.add_argument("--hf-peer", type=int, default=0, metavar="N",
                        help="also time HF transformers static `generate` (sdpa) on the first N requests of each "
                             "workload as one batch, and scale its time to the whole workload")
    args = parser.parse_args()

    import torch

    from batchllm import LLM, SamplingParams
    from batchllm.prefix.planner import plan_prefix_groups

    llm = LLM(model=args.model, attention_backend=args.attention_backend, kv_cache_tokens=args.kv_cache_tokens,
              max_num_batched_tokens=args.max_num_batched_tokens)
    engine = llm.engine
    arch = engine.arch
    print(f"model {args.model}: {arch.num_layers} layers, hidden {arch.hidden_size}, KV cache {engine.num_kv_tokens} tokens,"
          f" device {engine.device}", flush=True)
    base_config = engine.scheduler_config
    rows = []
    workloads = args.workload or ["micro:2000:200:16"]
    for spec_text in workloads:
        spec, _, count = spec_text.partition("#")  # "industrial#2000": this workload's request count
        num_requests = int(count) if count else args.requests
        workload = make_workload(spec, num_requests, args.output_tokens, arch.vocab_size, args.seed)
        prompts = [p.tolist() for p in workload.prompts]
        plan = plan_prefix_groups(prompts)
        groups = [(len(g.prefix_token_ids), [len(d) for d in g.distinct_token_ids], g.request_indices) for g in plan.groups]
        bound = flop_bound_seconds(arch, groups, workload.max_tokens)
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in workload.max_tokens]
        num_prompt_tokens = sum(len(p) for p in prompts)
        traces = []
        for policy_text in args.policies.split(","):
            label, name, changes, flags = parse_policy(policy_text)
            engine.scheduler_config = base_config
            engine.configure_scheduler(**changes)
            graphs = engine.runner.graphs
            if "eager" in flags:
                engine.runner.graphs = None
            engine.async_scheduling = "sync" not in flags
            step_events = None
            try:
                llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up: compile kernels
                if engine.device.type == "cuda":
                    torch.cuda.synchronize()
                    step_events = engine.runner.step_events = []
                started = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                if engine.device.type == "cuda":
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - started
                engine.runner.step_events = None
            except Exception as error:  # keep measuring the other policies; the row says what failed
                import traceback

                traceback.print_exc()
                engine.runner.graphs = graphs
                engine.runner.step_events = None
                rows.append({"workload": spec, "policy": label, "error": repr(error)})
                continue
            stats = llm.last_run_stats
            num_output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            assert num_output_tokens == sum(workload.max_tokens), "a request did not produce its fixed length"
            steps = stats.step_records
            computed_prefill = sum(s.num_distinct_tokens + s.num_prefix_tokens for s in steps)
            budget = engine.scheduler_config.max_num_batched_tokens
            tokens_per_step = [s.num_tokens for s in steps]
            row = {
                "workload": spec, "requests": len(prompts), "model": args.model, "policy": label,
                "seconds": round(seconds, 3), "req_per_s": round(len(prompts) / seconds, 2),
                "input_tok_per_s": round(num_prompt_tokens / seconds, 1),
                "output_tok_per_s": round(num_output_tokens / seconds, 1),
                "processed_prefill_tokens": computed_prefill,
                "saving_ratio": round(1 - computed_prefill / num_prompt_tokens, 4),
                "optimal_saving_ratio": round(plan.stats.saving_ratio, 4),
                "steps": len(steps), "mean_tokens_per_step": round(sum(tokens_per_step) / max(len(steps), 1), 1),
                "valley_steps": sum(1 for t in tokens_per_step if t < budget / 2),
                "peak_kv_blocks": max((s.num_used_blocks for s in steps), default=0),
                "mean_step_ms": round(1000 * sum(s.step_time_s for s in steps) / max(len(steps), 1), 2),
                "schedule_ms_per_step": round(1000 * sum(s.schedule_time_s for s in steps) / max(len(steps), 1), 2),
                "launch_ms_per_step": round(1000 * sum(s.launch_time_s for s in steps) / max(len(steps), 1), 2),
                "wait_ms_per_step": round(1000 * sum(s.wait_time_s for s in steps) / max(len(steps), 1), 2),
                "flop_bound_s": round(bound, 3), "time_over_bound": round(seconds / bound, 2),
            }
            if step_events:
                busy = gpu_busy_seconds(step_events)
                # GPU idle between steps = host work not hidden behind the GPU (issue 6: < 10%).
                row["gpu_busy_s"] = round(busy, 3)
                row["gpu_idle_ms_per_step"] = round(1000 * max(seconds - busy, 0.0) / max(len(steps), 1), 2)
                row["gpu_idle_fraction"] = round(max(seconds - busy, 0.0) / seconds, 4)
            row["async_scheduling"] = engine.async_scheduling
            engine.async_scheduling = True
            if graphs is not None:
                row["graph_replays"] = graphs.num_replays
            if args.trace_dir:
                traces.append(save_trace(args.trace_dir, spec, label, engine, steps))
            engine.runner.graphs = graphs
            rows.append(row)
            print(json.dumps(row), flush=True)
        if traces:
            from batchllm.cli.plot import plot_timelines

            plot_timelines(traces, os.path.join(args.trace_dir, f"timeline-{_slug(spec)}.png"),
                           title=f"{args.model}, {spec}, {len(prompts)} requests")
        if args.hf_peer and spec_text == workloads[0]:
            hf_seconds = time_hf_generate(arch, prompts[:args.hf_peer], args.output_tokens)
            scaled = hf_seconds * len(prompts) / min(args.hf_peer, len(prompts))
            row = {"workload": spec, "requests": len(prompts), "model": args.model,
                   "policy": f"hf-generate (static batch {min(args.hf_peer, len(prompts))}, sdpa; scaled)",
                   "seconds": round(scaled, 3), "req_per_s": round(len(prompts) / scaled, 2),
                   "output_tok_per_s": round(len(prompts) * args.output_tokens / scaled, 1),
                   "measured_seconds": round(hf_seconds, 3), "time_over_bound": round(scaled / bound, 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    commit = args.git_commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                               text=True).stdout.strip()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {"device": device, "date": datetime.date.today().isoformat(), "git_commit": commit or None, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
