"""Data parallelism on Ray against one GPU: throughput, balance and equal outputs, per workload.

Each workload's requests are built as `batchllm bench` builds them: generated prompts, greedy
sampling, EOS ignored, every output forced to --output-tokens. First one engine on one device
runs every workload (an untimed warm-up, then the timed run); that engine is freed, then
--replicas engine replicas on Ray (one GPU each; `batchllm run --ray`'s engine) run the same
requests, warm-up then timed run. One JSON line per measurement on stdout, appended to --out:

    # one GPU against two replicas on two GPUs, two workloads (#N: its request count)
    PYTHONPATH=. python3 benchmarks/scale_out_dp.py --model random:llama-3.1-8b \\
        --workload micro:2000:200:16#2048 --workload industrial#4000 --replicas 2 \\
        --out benchmarks/results/scale_out_dp.jsonl

    # a smoke test on a CPU (the replicas run on CPU cores: the times say nothing there)
    PYTHONPATH=. python3 benchmarks/scale_out_dp.py --model 'random:tiny?vocab_size=32000' \\
        --workload micro:64:8:4#16 --output-tokens 4 --replicas 2

Needs Ray (pip install 'batchllm[ray]'). Ray starts here with every visible GPU, or joins the
cluster in RAY_ADDRESS.

Each row ("what": "dp_throughput"; replicas 1 is the one-device engine):
  seconds, requests_per_s, output_tokens_per_s  the timed run, from the first request handed to
                         the engine to the last result back
  saving_ratio           prefill tokens the global prefix plan saves / all prompt tokens
  balance                the data-parallel plan's max / mean replica cost in tokens (1.0: even)
  sharing_kept           saved prefill tokens kept once groups are cut to fit the replicas
  replica_finish_seconds when the last result of each replica's shard came back (Ray rows),
                         measured_balance their max / mean
  outputs_equal          every request's greedy tokens on Ray equal the one-device tokens;
                         token_match the fraction of equal tokens, position by position
  speedup                one-device seconds / Ray seconds
  kv_cache_tokens        the engine's KV cache (Ray rows: the smallest replica's, each under
                         replica_kv_cache_tokens)
In bf16 a different batch composition may change the rounding and so flip a near-tie of random
weights: token_match then says how far the tokens still agree. By default each engine fills its
GPU's free memory with KV cache; this process keeps a CUDA context on the first GPU after the
one-device run, so the replica there may get a slightly smaller cache (--kv-cache-tokens N gives
every engine the same).
"""

from __future__ import annotations

import argparse
import dataclasses
import contextlib
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

DEFAULT_MODEL = "random:llama-3.1-8b"
CPU_SMOKE_MODEL = "random:tiny?vocab_size=32000"
SMALL_WARMUP_REQUESTS = 8  # as each policy's warm-up in `batchllm bench`

Log = Callable[[str], None]


class BenchError(Exception):
    """A setting or a request that cannot run; the message names the fix."""


@dataclass(frozen=True)
class Settings:
    model: str
    workloads: tuple[str, ...]  # "micro:P:D:SD[#N]" | "industrial[#N]"
    num_requests: int  # per workload without "#N"
    output_num_tokens: int  # per request
    num_replicas: int
    warmup: str  # "full" | "small"
    kv_cache_tokens: int | None  # None: fill free memory
    max_num_batched_tokens: int
    dtype: str
    seed: int
    out: str | None
    check_shards: bool = False


@dataclass(frozen=True)
class Case:
    """One workload's requests, checked nowhere yet (each engine checks them against its limits)."""

    label: str  # the workload spec, as `batchllm bench` names it in its rows
    requests: list  # PreparedRequest, request_id = position

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(request.prompt_token_ids) for request in self.requests)


@dataclass(frozen=True)
class PlanSummary:
    saving_ratio: float  # of the global prefix plan
    balance: float  # max / mean replica cost in tokens
    sharing_kept: float  # saved prefill tokens kept after assignment / saved by the global plan


@dataclass(frozen=True)
class TimedRun:
    seconds: float
    output_token_ids: dict[int, list[int]]  # request id -> generated tokens
    arrival_seconds: dict[int, float]  # request id -> seconds from the start until its result was here
    num_errors: int  # requests that finished with an error
    # --check-shards: tokens of the replicas' shards, each run alone on the one-device engine
    shard_token_ids: dict[int, list[int]] | None = None


# ---------------------------------------------------------------------------------------------
# Requests and plans


def make_case(spec_text: str, settings: Settings, vocab_size: int) -> Case:
    """The workload's requests as `batchllm bench` makes them (bench/runner.py: generated prompts,
    greedy, ignore_eos, max_tokens = the fixed output length)."""
    from batchllm.perf.workload import make_workload, split_workload_spec
    from batchllm.engine.request_state import PreparedRequest
    from batchllm.sampling_params import SamplingParams
    from batchllm.perf.workloads import DEFAULT_LOW_TOKEN_ID

    spec, num_requests = split_workload_spec(spec_text, settings.num_requests)
    if vocab_size <= DEFAULT_LOW_TOKEN_ID + 256:
        raise BenchError(f"the model's vocabulary ({vocab_size} tokens) is too small for generated workloads "
                         f"(token ids from {DEFAULT_LOW_TOKEN_ID} up): use a bigger one, e.g. {CPU_SMOKE_MODEL}")
    workload = make_workload(spec, num_requests, settings.output_num_tokens, vocab_size, settings.seed)
    requests = [PreparedRequest(index, prompt.tolist(), SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                       ignore_eos=True))
                for index, (prompt, max_tokens) in enumerate(zip(workload.prompts, workload.max_tokens))]
    return Case(spec, requests)


def plan_summaries(case: Case, num_replicas: int) -> dict[int, PlanSummary]:
    """The data-parallel plan (dp_plan.plan_replicas, as the Ray engine plans) for 1 and
    num_replicas replicas, over one global prefix plan."""
    from batchllm.distributed.dp_plan import plan_replicas
    from batchllm.config import RayDPConfig
    from batchllm.prefix.planner import plan_prefix_arrays

    prompts = [request.prompt_token_ids for request in case.requests]
    max_tokens = [request.params.max_tokens for request in case.requests]
    global_plan = plan_prefix_arrays(prompts)
    weight = RayDPConfig().decode_token_weight
    summaries = {}
    for count in sorted({1, num_replicas}):
        plan = plan_replicas(prompts, max_tokens, count, weight, plan=global_plan)
        summaries[count] = PlanSummary(global_plan.stats.saving_ratio, plan.balance, plan.sharing_kept)
    return summaries


def check_fits(case: Case, limits) -> None:
    """Every request runs whole on an engine with these RequestLimits (no max_tokens clamped)."""
    from batchllm.engine.request_limits import InvalidRequestError

    for request in case.requests:
        try:
            params = limits.check(request.prompt_token_ids, request.params)
        except InvalidRequestError as error:
            raise BenchError(f"{case.label}: request {request.request_id} cannot run: {error} "
                             "(fix: raise --kv-cache-tokens, or a workload with shorter prompts)") from None
        if params.max_tokens != request.params.max_tokens:
            needed = len(request.prompt_token_ids) + request.params.max_tokens
            raise BenchError(f"{case.label}: request {request.request_id} needs {needed} tokens, but one request "
                             f"may hold {limits.token_limit} here (fix: raise --kv-cache-tokens, or fewer "
                             "--output-tokens)")


# ---------------------------------------------------------------------------------------------
# Timing


def cuda_present() -> bool:
    import torch

    return torch.cuda.is_available()


def synchronizer(device) -> Callable[[], None]:
    import torch

    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def warmup_requests(requests: list, mode: str) -> list:
    """full: the timed batch itself (every shape of the timed run: kernels, CUDA graph captures);
    small: its first few requests (kernel compilation only)."""
    return requests if mode == "full" else requests[:SMALL_WARMUP_REQUESTS]


def warm_up(engine, requests: list, mode: str, log: Log) -> None:
    started = time.perf_counter()
    for _ in engine.run(warmup_requests(requests, mode)):
        pass
    log(f"  warm-up ({mode}, untimed): {time.perf_counter() - started:.1f} s")


def time_run(engine, requests: list, synchronize: Callable[[], None]) -> TimedRun:
    """engine.run over the whole batch, timed from the first request handed over to the last
    result back; every request's tokens and arrival time kept."""
    output_token_ids: dict[int, list[int]] = {}
    arrival_seconds: dict[int, float] = {}
    num_errors = 0
    synchronize()
    started = time.perf_counter()
    for done in engine.run(requests):
        arrival_seconds[done.request_id] = time.perf_counter() - started
        output_token_ids[done.request_id] = list(done.output_token_ids)
        num_errors += done.error is not None
    synchronize()
    return TimedRun(time.perf_counter() - started, output_token_ids, arrival_seconds, num_errors)


# ---------------------------------------------------------------------------------------------
# Rows


def max_over_mean(values: list[float]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean else 1.0


def token_match(reference: dict[int, list[int]], other: dict[int, list[int]]) -> float:
    """Fraction of the reference's tokens that other has at the same request and position."""
    num_tokens = sum(len(tokens) for tokens in reference.values())
    num_equal = sum(a == b for request_id, tokens in reference.items()
                    for a, b in zip(tokens, other.get(request_id, [])))
    return num_equal / num_tokens if num_tokens else 1.0


def base_row(settings: Settings, case: Case, run: TimedRun, plan: PlanSummary, device: str) -> dict:
    num_requests = len(case.requests)
    num_output_tokens = sum(len(tokens) for tokens in run.output_token_ids.values())
    return {
        "what": "dp_throughput", "model": settings.model, "workload": case.label, "device": device,
        "requests": num_requests, "prompt_tokens": case.num_prompt_tokens, "output_tokens": num_output_tokens,
        "errors": run.num_errors, "warmup": settings.warmup, "max_num_batched_tokens": settings.max_num_batched_tokens,
        "seconds": round(run.seconds, 3), "requests_per_s": round(num_requests / run.seconds, 2),
        "output_tokens_per_s": round(num_output_tokens / run.seconds, 1),
        "saving_ratio": round(plan.saving_ratio, 4), "balance": round(plan.balance, 4),
        "sharing_kept": round(plan.sharing_kept, 4),
    }


def one_device_row(settings: Settings, case: Case, run: TimedRun, plan: PlanSummary, engine) -> dict:
    device = engine.device
    return {**base_row(settings, case, run, plan, device_name(device)), "replicas": 1,
            "gpus": int(device.type == "cuda"), "kv_cache_tokens": engine.num_kv_tokens,
            "outputs_equal": None, "token_match": None, "speedup": None,
            **({"shards_alone_token_match": round(token_match(run.output_token_ids, run.shard_token_ids), 6)}
               if run.shard_token_ids is not None else {})}


def ray_row(settings: Settings, case: Case, run: TimedRun, plan: PlanSummary, reference: TimedRun,
            shards: list[list], dp, replica_kv_tokens: list[int]) -> dict:
    """reference: the one-device run of the same case. shards: what each replica ran (one shard
    a replica, in replica order, as ray_dp.stream_shards hands them out)."""
    finish_seconds = [max(run.arrival_seconds[request.request_id] for request in shard) for shard in shards]
    device = device_name_of_replicas(dp)
    return {**base_row(settings, case, run, plan, device), "replicas": dp.num_replicas,
            "gpus": int(dp.num_replicas * dp.gpus_per_replica), "kv_cache_tokens": min(replica_kv_tokens),
            "replica_kv_cache_tokens": replica_kv_tokens,
            "replica_finish_seconds": [round(seconds, 3) for seconds in finish_seconds],
            "measured_balance": round(max_over_mean(finish_seconds), 4),
            "outputs_equal": run.output_token_ids == reference.output_token_ids,
            "token_match": round(token_match(reference.output_token_ids, run.output_token_ids), 6),
            "speedup": round(reference.seconds / run.seconds, 3),
            **({"equal_to_shards_alone_on_one_device": run.output_token_ids == reference.shard_token_ids}
               if reference.shard_token_ids is not None else {})}


def device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def device_name_of_replicas(dp) -> str:
    """What each replica runs on (this host's first GPU names a local cluster's)."""
    import torch

    return torch.cuda.get_device_name(0) if dp.gpus_per_replica else "cpu"


def emit(row: dict, out: str | None) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")


# ---------------------------------------------------------------------------------------------
# The two measurements


def engine_config(settings: Settings):
    """The engine `batchllm bench` loads (bench/runner.load_llm) for these settings."""
    from batchllm.config import engine_config as build_config

    return build_config(settings.model, dtype=settings.dtype, kv_cache_tokens=settings.kv_cache_tokens,
                        seed=settings.seed, max_num_batched_tokens=settings.max_num_batched_tokens)


def run_shards_alone(engine, requests: list, settings: Settings) -> dict[int, list[int]]:
    """Each shard the replicas will run, alone on this engine (untimed): what a replica computes,
    if the engine is deterministic. Against the whole batch's tokens this measures how much a
    different batch composition alone changes (bf16 rounding flipping near-ties)."""
    from batchllm.config import RayDPConfig
    from batchllm.distributed.ray_dp import plan_shards

    tokens: dict[int, list[int]] = {}
    for shard in plan_shards(requests, RayDPConfig(num_replicas=settings.num_replicas)):
        tokens.update({done.request_id: list(done.output_token_ids) for done in engine.run(shard)})
    return tokens


def measure_one_device(settings: Settings, cases: list[Case], plans: list[dict], log: Log) -> list[TimedRun]:
    """Every case on one engine on one device; the engine and its GPU memory are freed on return."""
    from batchllm.perf.runner import free_device_memory
    from batchllm.engine.llm_engine import LLMEngine

    log(f"one device: loading {settings.model} ...")
    engine = LLMEngine(engine_config(settings))
    try:
        log(f"one device: {device_name(engine.device)}, KV cache {engine.num_kv_tokens} tokens")
        runs = []
        for case, plan in zip(cases, plans):
            check_fits(case, engine.limits)
            log(f"one device, {case.label}: {len(case.requests)} requests")
            warm_up(engine, case.requests, settings.warmup, log)
            run = time_run(engine, case.requests, synchronizer(engine.device))
            if settings.check_shards:
                run = dataclasses.replace(run, shard_token_ids=run_shards_alone(engine, case.requests, settings))
            runs.append(run)
            emit(one_device_row(settings, case, run, plan[1], engine), settings.out)
        return runs
    finally:
        del engine
        free_device_memory()


@contextlib.contextmanager
def ray_session(num_gpus: int) -> Iterator[None]:
    """Ray as `batchllm run --ray` finds it: connected already (kept as it is), the cluster in
    RAY_ADDRESS, else a local one started here with num_gpus GPUs (shut down on exit)."""
    import ray

    if ray.is_initialized():
        yield
        return
    resources = {} if os.environ.get("RAY_ADDRESS") else {"num_gpus": num_gpus}
    ray.init(include_dashboard=False, configure_logging=False, **resources)
    try:
        yield
    finally:
        ray.shutdown()


def ray_resource_problem(dp) -> str | None:
    """Why the connected Ray cluster cannot hold the replicas, or None."""
    import ray

    resources = ray.cluster_resources()
    for name, per_replica in (("GPU", dp.gpus_per_replica), ("CPU", dp.cpus_per_replica)):
        needed, present = dp.num_replicas * per_replica, resources.get(name, 0.0)
        if present < needed:
            return (f"--replicas {dp.num_replicas} needs {needed:g} {name}s on the Ray cluster, it has {present:g} "
                    f"(fix: fewer --replicas)")
    return None


def replica_kv_cache_tokens(engine) -> list[int]:
    """Each replica's KV cache in tokens, in replica order."""
    import ray

    limits = ray.get([replica.limits.remote() for replica in engine.replicas])
    return [limit.num_kv_blocks * limit.block_size for limit in limits]


def measure_on_ray(settings: Settings, cases: list[Case], plans: list[dict], references: list[TimedRun],
                   log: Log) -> None:
    """Every case on num_replicas Ray replicas (one GPU each where CUDA is present); a row each,
    compared with the one-device run (references, in case order)."""
    import ray

    from batchllm.config import ParallelConfig, RayDPConfig
    from batchllm.distributed.ray_dp import plan_shards
    from batchllm.distributed.ray_engine import RayEngine

    num_gpus = visible_gpu_count()
    dp = RayDPConfig(num_replicas=settings.num_replicas, gpus_per_replica=1 if num_gpus else 0)
    with ray_session(num_gpus):
        problem = ray_resource_problem(dp)
        if problem:
            raise BenchError(problem)
        log(f"Ray: starting {dp.num_replicas} replicas of {settings.model} ...")
        try:
            engine = RayEngine(dataclasses.replace(engine_config(settings), parallel=ParallelConfig(ray=dp)))
        except ray.exceptions.RayError as error:
            raise BenchError(f"a Ray replica could not load the model: {error}") from None
        try:
            kv_tokens = replica_kv_cache_tokens(engine)
            log(f"Ray: replica KV caches {kv_tokens} tokens")
            for case, plan, reference in zip(cases, plans, references):
                check_fits(case, engine.limits)
                log(f"Ray, {case.label}: {len(case.requests)} requests on {dp.num_replicas} replicas")
                warm_up(engine, case.requests, settings.warmup, log)
                run = time_run(engine, case.requests, lambda: None)  # results arrive after their steps ended
                row = ray_row(settings, case, run, plan[dp.num_replicas], reference, plan_shards(case.requests, dp),
                              dp, kv_tokens)
                emit(row, settings.out)
        finally:
            engine.shutdown()


def visible_gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_benchmark(settings: Settings, log: Log) -> None:
    """One device, then Ray, on every workload; rows on stdout and in settings.out."""
    from batchllm.models.loader import describe_model

    vocab_size = describe_model(settings.model).config.vocab_size
    cases = [make_case(spec, settings, vocab_size) for spec in settings.workloads]
    plans = [plan_summaries(case, settings.num_replicas) for case in cases]
    references = measure_one_device(settings, cases, plans, log)
    measure_on_ray(settings, cases, plans, references, log)


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help=f"random:PRESET, a .gguf file or a HF model directory (default: {DEFAULT_MODEL}, "
                             f"CUDA only; on a CPU e.g. '{CPU_SMOKE_MODEL}')")
    parser.add_argument("--workload", action="append", default=None, metavar="SPEC",
                        help="micro:P:D:SD (prefix P tokens, D distinct, sharing degree SD) or industrial, "
                             "optionally #N requests (repeatable; default micro:2000:200:16)")
    parser.add_argument("--requests", type=int, default=512, help="requests of a workload without #N (default 512)")
    parser.add_argument("--output-tokens", type=int, default=100,
                        help="output tokens of every request, EOS ignored (default 100)")
    parser.add_argument("--replicas", type=int, default=2, help="Ray replicas, one GPU each (default 2)")
    parser.add_argument("--warmup", default="full", choices=["full", "small"],
                        help="the untimed run before each timed one: full (default) runs the same batch, so "
                             f"every shape of the timed run is warm; small runs its first {SMALL_WARMUP_REQUESTS} "
                             "requests (faster, but CUDA graph captures may fall in the timed run)")
    parser.add_argument("--kv-cache-tokens", type=int, default=None,
                        help="KV cache of every engine in tokens (default: free GPU memory; 32768 on CPU)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="token budget of one step (default 2048)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                        help="auto: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--seed", type=int, default=0, help="workload and engine seed (default 0)")
    parser.add_argument("--out", default=None, metavar="FILE.jsonl", help="also append the rows here")
    parser.add_argument("--check-shards", action="store_true",
                        help="also run each replica's shard alone on the one-device engine (untimed) and compare "
                             "the Ray tokens with those: equal means data parallelism adds no difference of its "
                             "own beyond the batch composition")
    return parser.parse_args(argv)


def argument_problem(args: argparse.Namespace) -> str | None:
    if args.requests < 1 or args.output_tokens < 1:
        return "--requests and --output-tokens must be at least 1"
    if args.replicas < 1:
        return f"--replicas must be at least 1, got {args.replicas}"
    if args.kv_cache_tokens is not None and args.kv_cache_tokens < 1:
        return "--kv-cache-tokens must be at least 1"
    if args.max_num_batched_tokens < 1:
        return "--max-num-batched-tokens must be at least 1"
    return None


def environment_problem(args: argparse.Namespace) -> str | None:
    """Fewer visible GPUs than replicas (on a local cluster), or Ray missing."""
    num_gpus = visible_gpu_count()
    if num_gpus and num_gpus < args.replicas and not os.environ.get("RAY_ADDRESS"):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return (f"--replicas {args.replicas} needs {args.replicas} GPUs (one per replica), this host shows "
                f"{num_gpus}{f' (CUDA_VISIBLE_DEVICES={visible})' if visible is not None else ''} "
                f"(fix: --replicas {num_gpus} or fewer)")
    if importlib.util.find_spec("ray") is None:
        return "Ray is not installed: pip install 'batchllm[ray]'"
    return None


def resolve_model(args: argparse.Namespace) -> str:
    if args.model:
        if args.model.startswith("random:") and not args.model.startswith("random:tiny") and not cuda_present():
            print(f"warning: {args.model} on CPU is very slow; for a smoke test use --model '{CPU_SMOKE_MODEL}'",
                  file=sys.stderr)
        return args.model
    if cuda_present():
        return DEFAULT_MODEL
    raise BenchError(f"no CUDA GPU here, and {DEFAULT_MODEL} would take hours on a CPU (fix: pass --model, e.g. "
                     f"--model '{CPU_SMOKE_MODEL}' --workload micro:64:8:4#16 --output-tokens 4)")


def settings_from_args(args: argparse.Namespace) -> Settings:
    from batchllm.perf.workload import DEFAULT_WORKLOAD

    return Settings(model=resolve_model(args), workloads=tuple(args.workload or [DEFAULT_WORKLOAD]),
                    num_requests=args.requests, output_num_tokens=args.output_tokens, num_replicas=args.replicas,
                    warmup=args.warmup, kv_cache_tokens=args.kv_cache_tokens,
                    max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype, seed=args.seed,
                    out=args.out, check_shards=args.check_shards)


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 measured, 2 nothing measured (the message says why)."""
    args = parse_args(argv)
    problem = argument_problem(args) or environment_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        run_benchmark(settings_from_args(args), log=lambda text: print(text, file=sys.stderr, flush=True))
    except BenchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except SystemExit as error:  # a bad workload spec (bench/workload.py says what is wrong)
        if not isinstance(error.code, str):
            raise
        print(f"error: {error.code}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
