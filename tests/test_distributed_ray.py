"""Data parallelism on a local Ray cluster (2 replicas, 2 CPUs, ~100 MB object store): the outputs
equal a single-process run. Skipped where Ray is not installed (CI installs .[dev] only)."""

from __future__ import annotations

import json

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (optional extra: pip install 'batchllm[ray]')")
pytest.importorskip("ray.data", reason="ray[data] is not installed (optional extra: pip install 'batchllm[ray]')")

from batchllm.config import EngineConfig  # noqa: E402
from batchllm.distributed.ray_dp import RayDPConfig, ReplicaError, generate_on_ray, run_batch_file_on_ray  # noqa: E402
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

    # The CLI path: same output file shape as run_batch_file, in input order.
    lines = [{"custom_id": f"q{r.request_id}", "prompt_token_ids": r.prompt_token_ids, "max_tokens": 6,
              "temperature": r.params.temperature, "ignore_eos": True} for r in requests[:12]]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines) + "not json\n")
    summary = run_batch_file_on_ray(CONFIG, str(source), str(tmp_path / "out.jsonl"),
                                    RayDPConfig(num_replicas=2, cpus_per_replica=0.5))
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in records] == [f"q{i}" for i in range(12)] + [None]
    assert records[12]["error"]["code"] == "invalid_json"
    assert (summary["num_requests"], summary["num_errors"]) == (12, 1)
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 6 for r in records[:12])
    assert not (tmp_path / "out.jsonl.partial").exists()
