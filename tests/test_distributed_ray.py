"""Data parallelism on a local Ray cluster (2 replicas): the outputs equal a single-process run,
results stream back as each request finishes, and a Ray job journals, counts steps, stops and
resumes like a local one."""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

import numpy as np
import pytest

from model_helpers import normalized_records

from batchllm.job.batch_job import BatchJobOptions, StopRequest, run_batch_file
from batchllm.config import ParallelConfig, RayDPConfig, engine_config
from batchllm.distributed.ray_dp import (generate_on_ray, kill_replicas, plan_shards, start_replicas,
                                         stream_shards)
from batchllm.distributed.ray_engine import RayEngine
from batchllm.engine.llm_engine import LLMEngine, PreparedRequest
from batchllm.sampling_params import SamplingParams

pytest_plugins = ["ray_fixtures"]  # ray_address: skips where Ray is not installed

CONFIG = engine_config("random:tiny?seed=5", dtype="float32", device="cpu", kv_cache_tokens=1024)
DP = RayDPConfig(num_replicas=2, cpus_per_replica=1.0)
RAY_CONFIG = dataclasses.replace(CONFIG, parallel=ParallelConfig(ray=DP))  # what `batchllm run --ray` builds


def _requests() -> list[PreparedRequest]:
    rng = np.random.default_rng(1)
    prefixes = [rng.integers(3, 500, n).tolist() for n in (48, 30, 64)]
    requests = []
    for i in range(12):
        prompt = prefixes[i % 3] + rng.integers(3, 500, 3 + i % 4).tolist()
        params = SamplingParams(max_tokens=6, temperature=1.0 if i % 2 else 0.0, ignore_eos=True)  # seeds: engine's
        requests.append(PreparedRequest(i, prompt, params))
    requests.append(PreparedRequest(12, list(range(3, 1100)), SamplingParams(max_tokens=4)))  # > KV cache
    return requests


def test_ray_replicas_equal_single_process(ray_address, tmp_path):
    requests = _requests()
    single = {o.request_id: o.output_token_ids for o in LLMEngine(CONFIG).run(requests[:12])}
    outputs = generate_on_ray(CONFIG, requests, RayDPConfig(num_replicas=2, shards_per_replica=3))
    assert [o.request_id for o in outputs] == list(range(13))
    assert {o.request_id: o.output_token_ids for o in outputs[:12]} == single
    assert outputs[12].finish_reason == "error" and "prompt has 1097 tokens" in outputs[12].error

    # The CLI path (`batchllm run --ray`): the single-process batch job with the Ray engine gives
    # the same file as the single-process engine, errors included, and counts the replicas' steps.
    lines = [{"custom_id": f"q{r.request_id}", "prompt_token_ids": r.prompt_token_ids, "max_tokens": 6,
              "temperature": r.params.temperature, "ignore_eos": True} for r in requests[:12]]
    lines.append({"custom_id": "huge", "prompt_token_ids": requests[12].prompt_token_ids, "max_tokens": 4})
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines) + "not json\n")
    options = BatchJobOptions(show_progress=False)
    engine = RayEngine(RAY_CONFIG)
    summary = run_batch_file(engine, str(source), str(tmp_path / "ray.jsonl"), options=options)
    engine.shutdown()
    local = run_batch_file(LLMEngine(CONFIG), str(source), str(tmp_path / "local.jsonl"), options=options)

    def comparable(path):
        records = [json.loads(line) for line in (tmp_path / path).read_text().splitlines()]
        return [(r["custom_id"], r["error"]["code"] if r["error"] else r["response"]["body"]["usage"]["completion_tokens"])
                for r in records]

    assert comparable("ray.jsonl") == comparable("local.jsonl")
    assert comparable("ray.jsonl") == [(f"q{i}", 6) for i in range(12)] + [("huge", "prompt_too_long"), (None, "invalid_json")]
    assert not (tmp_path / "ray.jsonl.partial").exists()
    # Each replica runs at least 6 steps (6 tokens each); together never fewer than one process.
    assert summary.num_steps >= max(12, local.num_steps // 2)
    assert f"{summary.num_steps} steps)" in summary.describe()
    assert summary.num_output_tokens == local.num_output_tokens == 72


def test_results_stream_as_they_finish(ray_address):
    """Short and long requests share each replica's shard: the short ones reach the driver after a
    few engine steps, long before the shard's last result (not at the end of the shard)."""
    rng = np.random.default_rng(2)
    prefixes = [rng.integers(3, 500, 24).tolist() for _ in range(2)]
    requests = []
    for i in range(12):
        max_tokens = 2 if i % 4 < 2 else 160
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        requests.append(PreparedRequest(i, prefixes[i % 2] + rng.integers(3, 500, 4).tolist(), params))
    short = {r.request_id for r in requests if r.params.max_tokens == 2}
    shards = plan_shards(requests, DP)
    mixed = [{r.request_id for r in shard} for shard in shards]
    assert sum(bool(ids & short) and bool(ids - short) for ids in mixed) >= 1
    shard_of = {r.request_id: index for index, shard in enumerate(shards) for r in shard}
    replicas = start_replicas(CONFIG, DP)
    arrival: dict[int, tuple[float, int]] = {}  # request id -> (driver time, its shard's engine steps so far)
    shard_steps, delays_s = [0] * len(shards), []
    try:
        for update in stream_shards(replicas, shards, DP.stop_poll_s):
            if not update.finished:  # nothing arrived for stop_poll_s
                continue
            now = time.time()
            shard = shard_of[update.finished[0].request_id]  # an update comes from one shard
            assert {shard_of[done.request_id] for done in update.finished} == {shard}
            shard_steps[shard] += update.num_steps
            delays_s.append(now - update.finished_at_s)
            arrival.update({done.request_id: (now, shard_steps[shard]) for done in update.finished})
    finally:
        kill_replicas(replicas)
    assert sorted(arrival) == list(range(12))
    for ids in mixed:
        last_time, last_steps = max(arrival[i] for i in ids)
        assert last_steps >= 160
        for i in ids & short:  # a handful of steps (prefill + 2), not the shard's 160
            time_s, steps = arrival[i]
            assert steps <= last_steps // 4, (i, steps, last_steps)
            assert time_s < min(arrival[j][0] for j in ids - short)
    assert statistics.median(delays_s) < 2.0, delays_s


class _StopAfterResults:
    """Wraps an engine: once `after` results came out of a run, asks the job to stop as SIGTERM does."""

    def __init__(self, engine, stop: StopRequest, after: int) -> None:
        self.engine, self.stop, self.after = engine, stop, after

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def run(self, *args, **kwargs):
        for count, done in enumerate(self.engine.run(*args, **kwargs), 1):
            yield done
            if count == self.after:
                self.stop.signal_name, self.stop.exit_code = "SIGTERM", 143


def test_ray_job_stops_mid_run_and_resumes(ray_address, tmp_path):
    """A local run stops, Ray resumes its journal; Ray stops (its replicas are killed), a local run
    resumes it: both files equal an uninterrupted run."""
    lines = [{"custom_id": f"q{r.request_id}", "prompt_token_ids": r.prompt_token_ids,
              "max_tokens": 4 if r.request_id % 3 else 40, "temperature": 0.0, "ignore_eos": True}
             for r in _requests()[:12]]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    options = BatchJobOptions(show_progress=False, window_num_requests=6)
    engine, ray_engine = LLMEngine(CONFIG), RayEngine(RAY_CONFIG)
    run_batch_file(engine, str(source), str(tmp_path / "full.jsonl"), options=options)
    for first, second, name in ((engine, ray_engine, "a.jsonl"), (ray_engine, engine, "b.jsonl")):
        stop = StopRequest()
        stopped = run_batch_file(_StopAfterResults(first, stop, 1), str(source), str(tmp_path / name),
                                 options=options, stop=stop)
        assert stopped.interrupted_by == "SIGTERM" and 0 < stopped.num_requests < 6, stopped
        assert (ray_engine.replicas is None) == (first is ray_engine)
        resumed = run_batch_file(second, str(source), str(tmp_path / name), options=options)
        assert resumed.num_resumed == stopped.num_requests
        assert normalized_records(tmp_path / name) == normalized_records(tmp_path / "full.jsonl")
