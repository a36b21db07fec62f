"""Data parallelism on Ray against one GPU: throughput, balance and equal outputs, per workload.

Each workload's requests are built as `batchllm bench` builds them: generated prompts, greedy
sampling, EOS ignored, every output forced to --output-tokens. First one engine on one device
runs every workload (an untimed warm-up on its first 8 requests, as `batchllm bench` warms each
policy, then the timed run); that engine is freed, then --replicas engine replicas on Ray (one GPU
each; `batchllm run --ray`'s engine) run the same requests, warm-up then timed run. One JSON line
per measurement on stdout, appended to --out:

    PYTHONPATH=. python3 benchmarks/scale_out_dp.py --model random:llama-3.1-8b \\
        --workload micro:2000:200:16#2048 --workload industrial#4000 --replicas 2 --out scale_out_dp.jsonl

Needs Ray (pip install 'batchllm[ray]'). Ray starts here with every visible GPU, or joins the
cluster in RAY_ADDRESS. On a CPU (a smoke test: the times say nothing there) pass a small model,
e.g. --model 'random:tiny?vocab_size=32000' --workload micro:64:8:4#16 --output-tokens 4.

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
With --check-shards the one-device engine also runs each replica's shard alone (untimed), and the
rows say whether the Ray tokens equal those: in bf16 a different batch composition may change the
rounding and so flip a near-tie of random weights, which token_match then measures.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from batchllm.sched.config import DEFAULT_MAX_NUM_BATCHED_TOKENS

DEFAULT_MODEL = "random:llama-3.1-8b"
DEFAULT_REQUESTS = 512  # of a workload without "#N"
WARMUP_REQUESTS = 8  # as each policy's warm-up in `batchllm bench`

Log = Callable[[str], None]


class BenchError(Exception):
    """A setting or a request that cannot run; the message names the fix."""


@dataclass(frozen=True)
class Settings:
    model: str
    workloads: tuple[str, ...]  # "micro:P:D:SD[#N]" | "industrial[#N]"
    output_num_tokens: int  # per request
    num_replicas: int
    kv_cache_tokens: int | None  # None: fill free memory
    max_num_batched_tokens: int
    out: str | None
    check_shards: bool = False


@dataclass(frozen=True)
class Case:
    label: str  # the workload spec, as `batchllm bench` names it in its rows
    requests: list  # PreparedRequest, request_id = position
    saving_ratio: float  # of the global prefix plan
    plans: dict  # replicas (1 and num_replicas) -> the data-parallel plan (dp_plan.ReplicaPlan)


@dataclass(frozen=True)
class TimedRun:
    seconds: float
    output_token_ids: dict[int, list[int]]  # request id -> generated tokens
    arrival_seconds: dict[int, float]  # request id -> seconds from the start until its result was here
    num_errors: int  # requests that finished with an error
    # --check-shards: tokens of the replicas' shards, each run alone on the one-device engine
    shard_token_ids: dict[int, list[int]] | None = None


def make_case(spec_text: str, settings: Settings, vocab_size: int) -> Case:
    """The workload's requests as `batchllm bench` makes them, and the data-parallel plans (as the
    Ray engine plans) for 1 and num_replicas replicas over one global prefix plan."""
    from batchllm.distributed.dp_plan import plan_replicas
    from batchllm.config import RayDPConfig
    from batchllm.perf.workload import make_workload, prepared_requests, split_workload_spec
    from batchllm.prefix.planner import plan_prefix_arrays

    spec, num_requests = split_workload_spec(spec_text, DEFAULT_REQUESTS)
    workload = make_workload(spec, num_requests, settings.output_num_tokens, vocab_size, 0)
    requests = prepared_requests(workload)
    prompts, max_tokens = [r.prompt_token_ids for r in requests], list(workload.max_tokens)
    global_plan = plan_prefix_arrays(prompts)
    weight = RayDPConfig().decode_token_weight
    plans = {count: plan_replicas(prompts, max_tokens, count, weight, plan=global_plan)
             for count in sorted({1, settings.num_replicas})}
    return Case(spec, requests, global_plan.stats.saving_ratio, plans)


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
            raise BenchError(f"{case.label}: request {request.request_id} needs "
                             f"{len(request.prompt_token_ids) + request.params.max_tokens} tokens, but one request "
                             f"may hold {limits.token_limit} here (fix: raise --kv-cache-tokens, or fewer "
                             "--output-tokens)")


def warm_up(engine, requests: list, log: Log) -> None:
    started = time.perf_counter()
    for _ in engine.run(requests[:WARMUP_REQUESTS]):
        pass
    log(f"  warm-up (untimed): {time.perf_counter() - started:.1f} s")


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


def max_over_mean(values: list[float]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean else 1.0


def token_match(reference: dict[int, list[int]], other: dict[int, list[int]]) -> float:
    """Fraction of the reference's tokens that other has at the same request and position."""
    num_tokens = sum(len(tokens) for tokens in reference.values())
    num_equal = sum(a == b for request_id, tokens in reference.items()
                    for a, b in zip(tokens, other.get(request_id, [])))
    return num_equal / num_tokens if num_tokens else 1.0


def base_row(settings: Settings, case: Case, run: TimedRun, num_replicas: int, device: str) -> dict:
    num_requests = len(case.requests)
    num_output_tokens = sum(len(tokens) for tokens in run.output_token_ids.values())
    plan = case.plans[num_replicas]
    return {
        "what": "dp_throughput", "model": settings.model, "workload": case.label, "device": device,
        "requests": num_requests, "prompt_tokens": sum(len(r.prompt_token_ids) for r in case.requests),
        "output_tokens": num_output_tokens, "errors": run.num_errors,
        "seconds": round(run.seconds, 3), "requests_per_s": round(num_requests / run.seconds, 2),
        "output_tokens_per_s": round(num_output_tokens / run.seconds, 1),
        "saving_ratio": round(case.saving_ratio, 4), "balance": round(plan.balance, 4),
        "sharing_kept": round(plan.sharing_kept, 4), "replicas": num_replicas,
    }


def one_device_row(settings: Settings, case: Case, run: TimedRun, engine) -> dict:
    import torch

    device = engine.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    row = {**base_row(settings, case, run, 1, name), "gpus": int(device.type == "cuda"),
           "kv_cache_tokens": engine.num_kv_tokens, "outputs_equal": None, "token_match": None, "speedup": None}
    if run.shard_token_ids is not None:
        row["shards_alone_token_match"] = round(token_match(run.output_token_ids, run.shard_token_ids), 6)
    return row


def ray_row(settings: Settings, case: Case, run: TimedRun, reference: TimedRun, shards: list[list], dp,
            replica_kv_tokens: list[int]) -> dict:
    """reference: the one-device run of the same case. shards: what each replica ran (one shard
    a replica, in replica order, as ray_dp.stream_shards hands them out)."""
    import torch

    finish_seconds = [max(run.arrival_seconds[request.request_id] for request in shard) for shard in shards]
    device = torch.cuda.get_device_name(0) if dp.gpus_per_replica else "cpu"  # this host's names a local cluster's
    row = {**base_row(settings, case, run, dp.num_replicas, device),
           "gpus": int(dp.num_replicas * dp.gpus_per_replica), "kv_cache_tokens": min(replica_kv_tokens),
           "replica_kv_cache_tokens": replica_kv_tokens,
           "replica_finish_seconds": [round(seconds, 3) for seconds in finish_seconds],
           "measured_balance": round(max_over_mean(finish_seconds), 4),
           "outputs_equal": run.output_token_ids == reference.output_token_ids,
           "token_match": round(token_match(reference.output_token_ids, run.output_token_ids), 6),
           "speedup": round(reference.seconds / run.seconds, 3)}
    if reference.shard_token_ids is not None:
        row["equal_to_shards_alone_on_one_device"] = run.output_token_ids == reference.shard_token_ids
    return row


def emit(row: dict, out: str | None) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if out:
        with open(out, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")


def engine_config(settings: Settings):
    """The engine `batchllm bench` loads (perf/runner.load_llm) for these settings."""
    from batchllm.config import engine_config as build_config

    return build_config(settings.model, kv_cache_tokens=settings.kv_cache_tokens,
                        max_num_batched_tokens=settings.max_num_batched_tokens)


def run_shards_alone(engine, requests: list, num_replicas: int) -> dict[int, list[int]]:
    """Each shard the replicas will run, alone on this engine (untimed): what a replica computes,
    if the engine is deterministic."""
    from batchllm.config import RayDPConfig
    from batchllm.distributed.ray_dp import plan_shards

    tokens: dict[int, list[int]] = {}
    for shard in plan_shards(requests, RayDPConfig(num_replicas=num_replicas)):
        tokens.update({done.request_id: list(done.output_token_ids) for done in engine.run(shard)})
    return tokens


def measure_one_device(settings: Settings, cases: list[Case], log: Log) -> list[TimedRun]:
    """Every case on one engine on one device; the engine and its GPU memory are freed on return."""
    import torch

    from batchllm.engine.llm_engine import LLMEngine
    from batchllm.perf.runner import free_device_memory

    log(f"one device: loading {settings.model} ...")
    engine = LLMEngine(engine_config(settings))
    synchronize = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    try:
        runs = []
        for case in cases:
            check_fits(case, engine.limits)
            log(f"one device, {case.label}: {len(case.requests)} requests")
            warm_up(engine, case.requests, log)
            run = time_run(engine, case.requests, synchronize)
            if settings.check_shards:
                run = TimedRun(run.seconds, run.output_token_ids, run.arrival_seconds, run.num_errors,
                               run_shards_alone(engine, case.requests, settings.num_replicas))
            runs.append(run)
            emit(one_device_row(settings, case, run, engine), settings.out)
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


def measure_on_ray(settings: Settings, cases: list[Case], references: list[TimedRun], log: Log) -> None:
    """Every case on num_replicas Ray replicas (one GPU each where CUDA is present); a row each,
    compared with the one-device run (references, in case order)."""
    import ray

    from batchllm.config import ParallelConfig, RayDPConfig
    from batchllm.distributed.ray_dp import plan_shards
    from batchllm.distributed.ray_engine import RayEngine

    num_gpus = visible_gpu_count()
    dp = RayDPConfig(num_replicas=settings.num_replicas, gpus_per_replica=1 if num_gpus else 0)
    with ray_session(num_gpus):
        resources = ray.cluster_resources()
        for name, per_replica in (("GPU", dp.gpus_per_replica), ("CPU", dp.cpus_per_replica)):
            if resources.get(name, 0.0) < dp.num_replicas * per_replica:
                raise BenchError(f"--replicas {dp.num_replicas} needs {dp.num_replicas * per_replica:g} {name}s on "
                                 f"the Ray cluster, it has {resources.get(name, 0.0):g} (fix: fewer --replicas)")
        log(f"Ray: starting {dp.num_replicas} replicas of {settings.model} ...")
        try:
            engine = RayEngine(replace(engine_config(settings), parallel=ParallelConfig(ray=dp)))
        except ray.exceptions.RayError as error:
            raise BenchError(f"a Ray replica could not load the model: {error}") from None
        try:
            limits = ray.get([replica.limits.remote() for replica in engine.replicas])
            kv_tokens = [limit.num_kv_blocks * limit.block_size for limit in limits]
            for case, reference in zip(cases, references):
                check_fits(case, engine.limits)
                log(f"Ray, {case.label}: {len(case.requests)} requests on {dp.num_replicas} replicas")
                warm_up(engine, case.requests, log)
                run = time_run(engine, case.requests, lambda: None)  # results arrive after their steps ended
                emit(ray_row(settings, case, run, reference, plan_shards(case.requests, dp), dp, kv_tokens),
                     settings.out)
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
    references = measure_one_device(settings, cases, log)
    measure_on_ray(settings, cases, references, log)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"random:PRESET, a .gguf file or a HF model "
                                                               f"directory (default: {DEFAULT_MODEL})")
    parser.add_argument("--workload", action="append", default=None, metavar="SPEC",
                        help="micro:P:D:SD (prefix P tokens, D distinct, sharing degree SD) or industrial, "
                             f"optionally #N requests (default {DEFAULT_REQUESTS}; repeatable; default "
                             "micro:2000:200:16)")
    parser.add_argument("--output-tokens", type=int, default=100,
                        help="output tokens of every request, EOS ignored (default 100)")
    parser.add_argument("--replicas", type=int, default=2, help="Ray replicas, one GPU each (default 2)")
    parser.add_argument("--kv-cache-tokens", type=int, default=None,
                        help="KV cache of every engine in tokens (default: free GPU memory)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                        help=f"token budget per step of every engine (default {DEFAULT_MAX_NUM_BATCHED_TOKENS})")
    parser.add_argument("--out", default=None, metavar="FILE.jsonl", help="also append the rows here")
    parser.add_argument("--check-shards", action="store_true",
                        help="also run each replica's shard alone on the one-device engine (untimed) and compare "
                             "the Ray tokens with those")
    return parser.parse_args(argv)


def environment_problem(args: argparse.Namespace) -> str | None:
    """A bad number, fewer visible GPUs than replicas (on a local cluster), or Ray missing."""
    if min(args.output_tokens, args.replicas, args.kv_cache_tokens or 1) < 1:
        return "--output-tokens, --replicas and --kv-cache-tokens must be at least 1"
    num_gpus = visible_gpu_count()
    if num_gpus and num_gpus < args.replicas and not os.environ.get("RAY_ADDRESS"):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return (f"--replicas {args.replicas} needs {args.replicas} GPUs (one per replica), this host shows "
                f"{num_gpus}{f' (CUDA_VISIBLE_DEVICES={visible})' if visible is not None else ''} "
                f"(fix: --replicas {num_gpus} or fewer)")
    if importlib.util.find_spec("ray") is None:
        return "Ray is not installed: pip install 'batchllm[ray]'"
    return None


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 measured, 2 nothing measured (the message says why)."""
    from batchllm.perf.workload import DEFAULT_WORKLOAD

    args = parse_args(argv)
    problem = environment_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    settings = Settings(model=args.model, workloads=tuple(args.workload or [DEFAULT_WORKLOAD]),
                        output_num_tokens=args.output_tokens, num_replicas=args.replicas,
                        kv_cache_tokens=args.kv_cache_tokens, max_num_batched_tokens=args.max_num_batched_tokens,
                        out=args.out, check_shards=args.check_shards)
    try:
        run_benchmark(settings, log=lambda text: print(text, file=sys.stderr, flush=True))
    except BenchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except SystemExit as error:  # a bad workload spec (perf/workload.py says what is wrong)
        if not isinstance(error.code, str):
            raise
        print(f"error: {error.code}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
