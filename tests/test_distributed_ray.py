"""Data parallelism on a local Ray cluster (2 replicas, 2 CPUs, ~100 MB object store): the outputs
equal a single-process run. Skipped where Ray is not installed (CI installs .[dev] only)."""

from __future__ import annotations

import json

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (optional extra: pip install 'batchllm[ray]')")
pytest.importorskip("ray.data", reason="ray[data] is not installed (optional extra: pip install 'batchllm[ray]')")

from batchllm.config import EngineConfig  # noqa: E402
from batchllm.batch_job import BatchJobOptions, run_batch_file  # noqa: E402
from batchllm.distributed.ray_dp import RayDPConfig, ReplicaError, generate_on_ray  # noqa: E402
from batchllm.distributed.ray_engine import RayEngine  # noqa: E402
from batchllm.engine.llm_engine import LLMEngine, PreparedRequest  # noqa: E402
from batchllm.sampling_params import SamplingParams  # noqa: E402

CONFIG = EngineConfig(model="random:tiny?seed=5", dtype="float32", device="cpu", kv_cache_tokens=1024)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, object_store_memory=100 * 2**20, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    yield
    ray.shutdown()


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


def test_ray_replicas_equal_single_process(local_ray, tmp_path):
    requests = _requests()
    single = {o.request_id: o.output_token_ids for o in LLMEngine(CONFIG).run(requests[:12])}
    outputs = generate_on_ray(CONFIG, requests, RayDPConfig(num_replicas=2, cpus_per_replica=0.5, stream_every=4))
    assert [o.request_id for o in outputs] == list(range(13))
    assert {o.request_id: o.output_token_ids for o in outputs[:12]} == single
    assert isinstance(outputs[12], ReplicaError) and "prompt has 1097 tokens" in outputs[12].message

    # The CLI path (`batchllm run --ray`): the single-process batch job with the Ray engine gives
    # the same file as the single-process engine, errors included.
    lines = [{"custom_id": f"q{r.request_id}", "prompt_token_ids": r.prompt_token_ids, "max_tokens": 6,
              "temperature": r.params.temperature, "ignore_eos": True} for r in requests[:12]]
    lines.append({"custom_id": "huge", "prompt_token_ids": requests[12].prompt_token_ids, "max_tokens": 4})
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines) + "not json\n")
    options = BatchJobOptions(show_progress=False)
    run_batch_file(RayEngine(CONFIG, RayDPConfig(num_replicas=2, cpus_per_replica=0.5)), str(source),
                   str(tmp_path / "ray.jsonl"), options=options)
    run_batch_file(LLMEngine(CONFIG), str(source), str(tmp_path / "local.jsonl"), options=options)

    def comparable(path):
        records = [json.loads(line) for line in (tmp_path / path).read_text().splitlines()]
        return [(r["custom_id"], r["error"]["code"] if r["error"] else r["response"]["body"]["usage"]["completion_tokens"])
                for r in records]

    assert comparable("ray.jsonl") == comparable("local.jsonl")
    assert comparable("ray.jsonl") == [(f"q{i}", 6) for i in range(12)] + [("huge", "prompt_too_long"), (None, "invalid_json")]
    assert not (tmp_path / "ray.jsonl.partial").exists()


class _StopAfter:
    """A StopRequest that asks to stop after being polled `polls` times (a signal mid-job)."""

    def __init__(self, polls: int) -> None:
        self.polls, self.signal_name, self.exit_code = polls, None, 0

    @property
    def requested(self) -> bool:
        self.polls -= 1
        if self.polls < 0:
            self.signal_name, self.exit_code = "SIGTERM", 143
        return self.signal_name is not None


def test_ray_run_resumes_a_local_journal(local_ray, tmp_path):
    lines = [{"custom_id": f"q{r.request_id}", "prompt_token_ids": r.prompt_token_ids, "max_tokens": 6,
              "temperature": 0.0, "ignore_eos": True} for r in _requests()[:12]]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    options = BatchJobOptions(show_progress=False, window_num_requests=4)
    engine = LLMEngine(CONFIG)
    run_batch_file(engine, str(source), str(tmp_path / "full.jsonl"), options=options)
    stopped = run_batch_file(engine, str(source), str(tmp_path / "out.jsonl"), options=options, stop=_StopAfter(14))
    assert stopped.interrupted_by == "SIGTERM" and 0 < stopped.num_requests < 12
    resumed = run_batch_file(RayEngine(CONFIG, RayDPConfig(num_replicas=2, cpus_per_replica=0.5)), str(source),
                             str(tmp_path / "out.jsonl"), options=options)
    assert resumed.num_resumed == stopped.num_requests

    def tokens(path):
        return [(r["custom_id"], r["response"]["body"]["usage"]) for r in map(json.loads, path.read_text().splitlines())]

    assert tokens(tmp_path / "out.jsonl") == tokens(tmp_path / "full.jsonl")
