"""Run several policies in ONE process on the same model and measure each (`batchllm bench`): one
row per (workload, policy), as docs/design.md ("Benchmark harness") describes, then the HF
generate peer once every engine is freed. Every new row is handed to an `on_update` callback
with the whole result so far (the command line rewrites its output files with it)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from batchllm.config import DEFAULT_GPU_MEMORY_UTILIZATION
from batchllm.perf.device_memory import allocator_counts, allocator_counts_since, free_device_memory
from batchllm.perf.engine_variants import EngineVariant
from batchllm.perf.flop_bound import (H200_BF16_PEAK_FLOPS, WorkFlops, flop_bound_seconds, peak_flops_for,
                                       plan_groups, work_flop_parts)
from batchllm.perf.policies import PolicySpec, parse_policies
from batchllm.perf.roofline import H200_COPY_BANDWIDTH_BYTES_PER_S, TrafficModel, roofline
from batchllm.perf.schedule_replay import replay_schedule
from batchllm.perf.workload import DEFAULT_WORKLOAD, make_workload, read_input_workload, split_workload_spec
from batchllm.engine.run_options import RunOptions
from batchllm.sched.trace import Trace, write_trace
from batchllm.sched.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from batchllm.perf.workloads import DEFAULT_LOW_TOKEN_ID

GIB = 1 << 30

ResultListener = Callable[[dict], None]  # gets the whole result so far, after every new row


@dataclass
class BenchOptions:
    model: str
    workloads: list[str] = field(default_factory=list)  # "micro:P:D:SD[#N]" | "industrial[#N]"
    inputs: list[str] = field(default_factory=list)  # JSONL files
    requests: int = 512
    output_tokens: int = 100
    policies: str = "batchllm,vllm,sglang"
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    attention_backend: str = "auto"
    kv_cache_tokens: int | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    # The engines to measure, one after the other in this process (each loads the model anew); every
    # row is tagged with its engine's quantization, KV cache dtype and tensor parallel size.
    variants: tuple[EngineVariant, ...] = (EngineVariant(),)
    trace_dir: str | None = None
    git_commit: str | None = None
    # Batch sizes at which to time HF generate on the first workload (empty: no peer), over whole
    # batches covering its first hf_peer_requests requests (None: the largest batch size).
    hf_peer: tuple[int, ...] = ()
    hf_peer_requests: int | None = None
    # An untimed pass of the first policy over each workload before its timed runs, so that the
    # one-time costs of its shapes (docs/design.md; about 1 s on the 8B micro set) fall on no policy.
    warm_pass: bool = True


@dataclass
class _Case:
    label: str  # the rows' "workload"
    prompts: list[list[int]]
    max_tokens: list[int]
    skipped_lines: int | None = None  # --input files only


SCHEDULER_SETTINGS = ("policy", "max_num_seqs", "max_num_batched_tokens")  # what a policy label sets


def slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text).strip("-")


def save_trace(directory: str, workload: str, label: str, engine, steps):
    config = engine.scheduler_config
    trace = Trace(policy=label, max_num_batched_tokens=config.max_num_batched_tokens,
                  num_kv_blocks=config.num_kv_blocks, block_size=config.block_size, label=workload, steps=list(steps))
    os.makedirs(directory, exist_ok=True)
    write_trace(trace, os.path.join(directory, f"trace-{slug(workload)}-{slug(label)}.json"))
    return trace


def engine_kv_bytes_per_token(engine) -> int:
    """Bytes of one token's keys and values in the engine's KV cache: one byte an element for an
    FP8 cache (kv_cache_dtype "fp8"), else the model dtype's size."""
    import torch

    from batchllm.engine.kv_cache import kv_bytes_per_token

    arch = engine.arch
    dtype = torch.float8_e4m3fn if engine.config.cache.kv_cache_dtype == "fp8" else engine.dtype
    return kv_bytes_per_token(arch.num_layers, arch.num_kv_heads, arch.head_dim, dtype)


def engine_traffic(engine) -> TrafficModel:
    """Bytes per element the roofline charges an engine's steps (roofline.TrafficModel)."""
    itemsize = engine.dtype.itemsize
    return TrafficModel(weight_bytes_per_element=1 if engine.config.quantization == "fp8" else itemsize,
                        lm_head_bytes_per_element=itemsize, kv_bytes_per_token=engine_kv_bytes_per_token(engine))


def engine_tags(engine) -> dict:
    """What every row says about the engine that produced it."""
    return {"quantization": engine.config.quantization, "kv_cache_dtype": engine.config.cache.kv_cache_dtype,
            "attention_backend": engine.runner.attention_backend,
            "tensor_parallel_size": engine.config.parallel.tensor.size,
            "kv_cache_tokens": engine.num_kv_tokens,
            "gpu_memory_utilization": engine.config.cache.gpu_memory_utilization}


GIT_COMMIT_ENV = "BATCHLLM_GIT_COMMIT"


def git_commit(directory: str | None = None) -> str | None:
    """Short commit of the checkout holding this package (or `directory`), with "-dirty" when
    tracked files differ from it, so a row never names a commit its code was not; None outside
    git. $BATCHLLM_GIT_COMMIT, when set, names it instead: for a copy of a checkout whose git
    metadata is not the tree's own."""
    named = os.environ.get(GIT_COMMIT_ENV, "").strip()
    if named:
        return named
    if directory is None:
        directory = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", directory, *args], capture_output=True, text=True, timeout=10,
                              check=False)
    try:
        head = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    commit = head.stdout.strip() if head.returncode == 0 else ""
    if not commit:
        return None
    return commit + "-dirty" if changed.returncode == 0 and changed.stdout.strip() else commit


def compiled_kernel_variants() -> dict[str, int]:
    """Compiled variants of each Triton kernel of batchllm.ops in this process. One per dtype /
    tile config is expected; more means some step compiled a new specialisation mid-run (Triton
    specialises on pointer alignment and integer divisibility, as unaligned plan views once did).
    Empty under the interpreter or before any launch."""
    import importlib

    counts: dict[str, int] = {}
    for module_name in ("attention_kernels", "kv_store", "fused_layers"):
        module = importlib.import_module(f"batchllm.ops.{module_name}")
        for name, fn in vars(module).items():
            caches = getattr(fn, "device_caches", None)
            if not isinstance(caches, dict) or not hasattr(fn, "run"):
                continue
            num = sum(len(entry[0]) for entry in caches.values() if entry and isinstance(entry[0], dict))
            if num:
                counts[name] = num
    return counts


def engine_options(options: BenchOptions, variant: EngineVariant = EngineVariant()) -> dict:
    """The LLM(...) (and engine_config) options of one engine variant; every setting the bench does
    not name keeps LLM's default."""
    return dict(model=options.model, dtype=options.dtype, device=options.device, quantization=variant.quantization,
                kv_cache_dtype=variant.kv_cache_dtype, kv_cache_tokens=options.kv_cache_tokens,
                gpu_memory_utilization=options.gpu_memory_utilization,
                attention_backend=options.attention_backend, seed=options.seed,
                max_num_batched_tokens=options.max_num_batched_tokens)


def check_engines(options: BenchOptions) -> None:
    """Every variant's engine configuration, checked against this machine before any model loads
    (ValueError naming the fix)."""
    from batchllm.config import engine_config
    from batchllm.engine.host_check import check_host

    for variant in options.variants:
        check_host(engine_config(**engine_options(options, variant)))


def load_llm(options: BenchOptions, variant: EngineVariant = EngineVariant()):
    """A batchllm.LLM for one engine variant."""
    from batchllm import LLM

    return LLM(**engine_options(options, variant))


def _generated_case(spec_text: str, options: BenchOptions, vocab_size: int) -> _Case:
    spec, num_requests = split_workload_spec(spec_text, options.requests)
    if vocab_size <= DEFAULT_LOW_TOKEN_ID + 256:
        raise SystemExit(f"the model's vocabulary ({vocab_size} tokens) is too small for generated workloads "
                         f"(token ids from {DEFAULT_LOW_TOKEN_ID} up): use a bigger one, e.g. "
                         "random:tiny?vocab_size=32000, or give --input FILE")
    workload = make_workload(spec, num_requests, options.output_tokens, vocab_size, options.seed)
    return _Case(spec, [p.tolist() for p in workload.prompts], list(workload.max_tokens))


def _input_case(path: str, engine, options: BenchOptions, log: Callable[[str], None]) -> _Case:
    workload, skipped = read_input_workload(path, engine, default_max_tokens=options.output_tokens)
    for line in skipped[:20]:
        log(f"{path} line {line.line_number}: skipped ({line.code}: {line.message})")
    if len(skipped) > 20:
        log(f"... and {len(skipped) - 20} more skipped lines")
    log(f"{path}: {workload.num_requests} requests, {len(skipped)} lines skipped")
    return _Case(workload.name, [p.tolist() for p in workload.prompts], list(workload.max_tokens),
                 skipped_lines=len(skipped))


def graph_replay_counts(runner) -> dict[str, int]:
    """The runner's steps by how they ran and its CUDA graph replays so far, by row field
    (ModelRunner.graph_counts: graph_replays, piecewise_steps, piece_replays, eager_steps); a run's
    own are graph_replays_since(runner, the counts before it)."""
    return runner.graph_counts()


def graph_replays_since(runner, before: dict[str, int]) -> dict[str, int]:
    """The replays since graph_replay_counts returned `before`, by row field."""
    return {name: count - before[name] for name, count in graph_replay_counts(runner).items()}


def significant(value: float, digits: int = 4) -> float:
    return float(f"{value:.{digits}g}")


def roofline_fields(engine, case: _Case, seconds: float, steps) -> dict:
    """The row's roofline (roofline.py) over the run's steps, their chunks replayed on the host
    (schedule_replay.py) under the scheduler settings the run had; roofline_replay_matches_run
    says whether the replay made the same steps as the run's records."""
    replay = replay_schedule(case.prompts, case.max_tokens, engine.scheduler_config)
    bound = roofline(engine.arch, replay.steps, engine_traffic(engine), peak_flops_for(engine.config.quantization))
    return {"roofline_s": significant(bound.seconds), "time_over_roofline": round(seconds / bound.seconds, 2),
            "serial_roofline_s": significant(bound.serial_seconds),
            "time_over_serial_roofline": round(seconds / bound.serial_seconds, 2),
            "roofline_memory_bound_steps": bound.num_memory_bound_steps,
            "roofline_bandwidth_tb_per_s": round(H200_COPY_BANDWIDTH_BYTES_PER_S / 1e12, 2),
            "roofline_replay_matches_run": replay.matches(steps)}


def run_policy(llm, case: _Case, policy: PolicySpec, params, plan, work: WorkFlops, model: str,
               base_settings: dict) -> dict:
    """One (workload, policy) row. work: the workload's FLOPs (flop_bound.work_flop_parts), whose
    FLOP bound is taken at the engine's peak (flop_bound.peak_flops_for). base_settings: the
    scheduler settings a label does not set. Raises what the run raises (the caller turns it into
    a row)."""
    import torch

    engine = llm.engine
    prompts = case.prompts
    engine.configure_scheduler(**{**base_settings, **policy.changes})
    options = RunOptions(cuda_graphs="eager" not in policy.flags, async_scheduling="sync" not in policy.flags)
    synchronize = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    llm.generate(prompts[:8], params[:8], use_tqdm=False, options=options)  # warm-up: compile kernels
    synchronize()
    replays_before = graph_replay_counts(engine.runner)
    allocator_before = allocator_counts(engine.device)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, options=options)
    synchronize()
    seconds = time.perf_counter() - started
    num_prompt_tokens = sum(len(p) for p in prompts)
    num_output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    if num_output_tokens != sum(case.max_tokens):
        raise RuntimeError("a request did not produce its fixed length")
    steps = llm.last_run_stats.step_records
    computed_prefill = sum(s.num_distinct_tokens + s.num_prefix_tokens for s in steps)
    budget = engine.scheduler_config.max_num_batched_tokens
    tokens_per_step = [s.num_tokens for s in steps]
    num_steps = max(len(steps), 1)
    peak_blocks = max((s.num_used_blocks for s in steps), default=0)
    peak_bytes = peak_blocks * engine.scheduler_config.block_size * engine_kv_bytes_per_token(engine)
    peak_flops = peak_flops_for(engine.config.quantization)
    bound = work.bound_seconds(peak_flops)
    row = {
        "workload": case.label, "requests": len(prompts), "model": model, "policy": policy.label,
        **engine_tags(engine),
        "seconds": round(seconds, 3), "req_per_s": round(len(prompts) / seconds, 2),
        "input_tok_per_s": round(num_prompt_tokens / seconds, 1),
        "output_tok_per_s": round(num_output_tokens / seconds, 1),
        "processed_prefill_tokens": computed_prefill,
        "saving_ratio": round(1 - computed_prefill / num_prompt_tokens, 4),
        "optimal_saving_ratio": round(plan.stats.saving_ratio, 4),
        "steps": len(steps), "mean_tokens_per_step": round(sum(tokens_per_step) / num_steps, 1),
        "valley_steps": sum(1 for t in tokens_per_step if t < budget / 2),
        "peak_kv_blocks": peak_blocks,
        "peak_kv_gib": float(f"{peak_bytes / GIB:.4g}"),
        "mean_step_ms": round(1000 * sum(s.step_time_s for s in steps) / num_steps, 2),
        "schedule_ms_per_step": round(1000 * sum(s.schedule_time_s for s in steps) / num_steps, 2),
        "launch_ms_per_step": round(1000 * sum(s.launch_time_s for s in steps) / num_steps, 2),
        "wait_ms_per_step": round(1000 * sum(s.wait_time_s for s in steps) / num_steps, 2),
        "flop_bound_s": round(bound, 3), "time_over_bound": round(seconds / bound, 2),
        "flop_bound_peak_tflop_per_s": round(peak_flops / 1e12, 1),
        "attention_flop_share": round(work.attention_share, 4),
        **roofline_fields(engine, case, seconds, steps),
        "kv_bytes_per_token": engine_kv_bytes_per_token(engine),
        "async_scheduling": options.async_scheduling,
    }
    row.update(graph_replays_since(engine.runner, replays_before))
    row.update(allocator_counts_since(engine.device, allocator_before))
    if case.skipped_lines is not None:
        row["skipped_lines"] = case.skipped_lines
    return row


def _sources(options: BenchOptions) -> list[tuple[str, str]]:
    """("workload", spec) and ("input", path) in the order they run."""
    specs = options.workloads or ([] if options.inputs else [DEFAULT_WORKLOAD])
    return [("workload", spec) for spec in specs] + [("input", path) for path in options.inputs]


def _make_case(kind: str, source: str, engine, options: BenchOptions, log: Callable[[str], None]) -> _Case:
    if kind == "workload":
        return _generated_case(source, options, engine.arch.vocab_size)
    return _input_case(source, engine, options, log)


def run_bench(options: BenchOptions, llm, log: Callable[[str], None] = print,
              on_update: ResultListener | None = None) -> dict:
    """Run every workload under every policy on `llm` (a loaded batchllm.LLM, one engine variant);
    returns {device, date, git_commit, model, rows, ...}, also handed to on_update after every
    row. run_variants runs each of options.variants, then the HF peer."""
    import torch

    from batchllm import SamplingParams
    from batchllm.prefix.planner import plan_prefix_groups

    policies = parse_policies(options.policies)
    engine = llm.engine
    arch = engine.arch
    log(f"model {options.model}: {arch.num_layers} layers, hidden {arch.hidden_size}, "
        f"KV cache {engine.num_kv_tokens} tokens, device {engine.device}, "
        f"{EngineVariant(engine.config.quantization, engine.config.cache.kv_cache_dtype).label}")
    base_settings = {name: getattr(engine.scheduler_config, name) for name in SCHEDULER_SETTINGS}
    device = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else engine.device.type
    result = {"device": device, "date": datetime.date.today().isoformat(),
              "git_commit": options.git_commit or git_commit(), "model": options.model,
              "kv_bytes_per_token": engine_kv_bytes_per_token(engine),
              "compiled_kernel_variants": compiled_kernel_variants(), "rows": []}
    inputs: list[dict] = []

    def add_row(row: dict) -> None:
        result["rows"].append(row)
        result["compiled_kernel_variants"] = compiled_kernel_variants()
        log(json.dumps(row))
        if on_update is not None:
            on_update(result)

    for index, (kind, source) in enumerate(_sources(options)):
        case = _make_case(kind, source, engine, options, log)
        if kind == "input":
            inputs.append({"file": source, "workload": case.label, "requests": len(case.prompts),
                           "skipped_lines": case.skipped_lines})
            result["inputs"] = inputs
            if not case.prompts:
                log(f"{source}: no request can run, skipped")
                continue
        plan = plan_prefix_groups(case.prompts)
        work = work_flop_parts(arch, plan_groups(plan), case.max_tokens)
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in case.max_tokens]
        # Decode graphs are captured per (rows bucket, block-table width), and a workload's widths
        # follow its prompt lengths: each workload gets its own untimed pass, or its first policy
        # would pay the captures of its shapes and the others would not.
        if options.warm_pass:
            started = time.perf_counter()
            engine.configure_scheduler(**{**base_settings, **policies[0].changes})
            llm.generate(case.prompts, params, use_tqdm=False, options=RunOptions())
            log(f"warm pass ({policies[0].name}, untimed): {time.perf_counter() - started:.1f} s")
        traces: list = []
        for policy in policies:
            try:
                row = run_policy(llm, case, policy, params, plan, work, options.model, base_settings)
                if options.trace_dir:
                    steps = llm.last_run_stats.step_records
                    traces.append(save_trace(options.trace_dir, case.label, policy.label, engine, steps))
            except Exception as error:  # noqa: BLE001 -- keep measuring the other policies; the row says what failed
                traceback.print_exc()
                row = {"workload": case.label, "policy": policy.label, **engine_tags(engine), "error": repr(error)}
            add_row(row)
        engine.configure_scheduler(**base_settings)
        if traces:
            from batchllm.perf.plot import plot_timelines

            plot_timelines(traces, os.path.join(options.trace_dir, f"timeline-{slug(case.label)}.png"),
                           title=f"{options.model}, {case.label}, {len(case.prompts)} requests")
    result["compiled_kernel_variants"] = compiled_kernel_variants()
    return result


def peer_job(options: BenchOptions, llm):
    """The HF peer's job (hf_peer.PeerJob) on the first workload, taken from a loaded engine before
    it is freed; None when that workload has no request."""
    from batchllm.perf.hf_peer import PeerJob
    from batchllm.prefix.planner import plan_prefix_groups

    engine = llm.engine
    case = _make_case(*_sources(options)[0], engine, options, log=lambda text: None)
    if not case.prompts:
        return None
    # HF generate runs the model unquantized: its bound is at the bf16 peak whatever the engine ran
    bound = flop_bound_seconds(engine.arch, plan_groups(plan_prefix_groups(case.prompts)), case.max_tokens,
                               H200_BF16_PEAK_FLOPS)
    return PeerJob(case.label, options.model, engine.arch, engine.device, engine.dtype, case.prompts,
                   case.max_tokens, bound)


def run_peer(job, options: BenchOptions, log: Callable[[str], None]) -> dict:
    """The HF peer's row, or a row with its error."""
    from batchllm.perf.hf_peer import hf_peer_row

    num_requests = options.hf_peer_requests or max(options.hf_peer)
    try:
        return hf_peer_row(job, options.hf_peer, num_requests, log)
    except Exception as error:  # noqa: BLE001 -- the engine rows stay; the row says what failed
        traceback.print_exc()
        return {"workload": job.workload_label, "policy": "hf-generate", "quantization": None,
                "kv_cache_dtype": "auto", "tensor_parallel_size": 1, "error": repr(error)}


LOAD_ERRORS = (FileNotFoundError, ValueError, OSError)  # a model or setting that cannot load: a note, not a crash


def merge_results(results: list[dict]) -> dict:
    """One result of several variants' run_bench results: the first's header, every row in order,
    the last count of compiled kernels (they add up in the process). kv_bytes_per_token stays at the
    top only when every variant has the same; the rows carry their own."""
    merged = {**results[0], "rows": [row for result in results for row in result["rows"]],
              "compiled_kernel_variants": results[-1]["compiled_kernel_variants"]}
    if len({result["kv_bytes_per_token"] for result in results}) > 1:
        del merged["kv_bytes_per_token"]
    return merged


def _combined(options: BenchOptions, results: list[dict], load_errors: list[dict], extra_rows: list[dict]) -> dict:
    result = merge_results(results) if results else {"model": options.model, "rows": []}
    result["rows"] = result["rows"] + extra_rows
    if load_errors:
        result["load_errors"] = list(load_errors)
    return result


def run_variants(options: BenchOptions, load: Callable = load_llm, log: Callable[[str], None] = print,
                 on_update: ResultListener | None = None) -> dict:
    """run_bench on each of options.variants in turn, each on its own engine (load(options, variant)),
    freed before the next loads; then, with every engine freed, the HF peer (options.hf_peer) on
    the first workload. A variant that cannot load is listed under "load_errors" (the rendered
    table notes it) and the others still run; with no variant loaded, the result has no rows.
    on_update gets the whole result so far after every row."""
    results: list[dict] = []
    load_errors: list[dict] = []
    job = None

    def publish(current: dict | None = None, extra_rows: tuple[dict, ...] = ()) -> None:
        if on_update is not None:
            on_update(_combined(options, results + ([current] if current else []), load_errors, list(extra_rows)))

    for variant in options.variants:
        try:
            llm = load(options, variant)
        except LOAD_ERRORS as error:
            load_errors.append({"quantization": variant.quantization, "kv_cache_dtype": variant.kv_cache_dtype,
                                "error": f"cannot load the model {options.model} ({variant.label}): {error}"})
            continue
        try:
            results.append(run_bench(options, llm, log, on_update=publish))
            if options.hf_peer and job is None:
                job = peer_job(options, llm)
        finally:
            llm.engine.shutdown()  # tensor parallel workers
            del llm
            free_device_memory()
    peer_rows: list[dict] = []
    if job is not None:
        peer_rows.append(run_peer(job, options, log))
        log(json.dumps(peer_rows[-1]))
        publish(extra_rows=tuple(peer_rows))
    return _combined(options, results, load_errors, peer_rows)
