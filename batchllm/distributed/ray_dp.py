"""Data parallelism on Ray Data (optional extra: pip install 'batchllm[ray]').

The driver plans prefix groups over the WHOLE batch and assigns whole groups to shards
(dp_plan); Ray Data runs one LLMEngine per replica over one shard per input row and streams the
finished requests back. Why pre-bucketed shards rather than Ray's own grouping:
docs/scale-out.md ("Data parallelism on Ray Data").
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from batchllm.distributed.dp_plan import ReplicaPlan, plan_replicas

RAY_MISSING = "Ray is not installed: pip install 'batchllm[ray]' (ray[data])"
DEFAULT_COST_MAX_TOKENS = 256  # decode tokens assumed for cost when a request has no max_tokens


@dataclass(frozen=True)
class RayDPConfig:
    num_replicas: int = 2
    gpus_per_replica: float = 0.0  # 1 per replica on GPU clusters (tensor parallel inside: more)
    cpus_per_replica: float = 1.0
    shards_per_replica: int = 1  # >1: smaller shards, Ray balances them dynamically over replicas
    stream_every: int = 64  # finished requests per streamed batch
    decode_token_weight: float = 1.0  # cost of a decode token relative to a prefill token

    def __post_init__(self) -> None:
        if self.num_replicas < 1 or self.shards_per_replica < 1 or self.stream_every < 1:
            raise ValueError("num_replicas, shards_per_replica and stream_every must be >= 1")


@dataclass(frozen=True)
class ReplicaError:
    """A request the replica could not run (e.g. too long for its KV cache)."""

    request_id: int
    message: str


class EngineReplica:
    """Ray Data class UDF: one LLMEngine per actor, one shard per call."""

    def __init__(self, engine_config, stream_every: int) -> None:
        from batchllm.engine.llm_engine import LLMEngine

        self.engine = LLMEngine(engine_config)
        self.stream_every = stream_every

    def __call__(self, batch: dict) -> Iterator[dict]:
        from batchllm.request_limits import InvalidRequestError

        for payload in batch["payload"]:
            requests = pickle.loads(payload)
            runnable, errors = [], []
            limits = self.engine.limits  # this replica's KV cache, maybe smaller than the driver assumed
            for request in requests:
                try:
                    params = limits.check(request.prompt_token_ids, request.params)
                    runnable.append(dataclasses.replace(request, params=params))
                except InvalidRequestError as error:
                    errors.append(ReplicaError(request.request_id, str(error)))
            pending: list = list(errors)
            for done in self.engine.run(runnable):
                pending.append(done)
                if len(pending) >= self.stream_every:
                    yield {"payload": np.array([pickle.dumps(pending)], dtype=object)}
                    pending = []
            if pending:
                yield {"payload": np.array([pickle.dumps(pending)], dtype=object)}


def plan_shards(requests: Sequence, dp: RayDPConfig) -> ReplicaPlan:
    """PreparedRequests -> global plan, whole groups to num_replicas * shards_per_replica shards."""
    prompts = [request.prompt_token_ids for request in requests]
    max_tokens = [request.params.max_tokens if request.params.max_tokens is not None else DEFAULT_COST_MAX_TOKENS
                  for request in requests]
    return plan_replicas(prompts, max_tokens, dp.num_replicas * dp.shards_per_replica, dp.decode_token_weight)


def run_on_ray(engine_config, requests: Sequence, dp: RayDPConfig) -> Iterator[object]:
    """Yields FinishedOutput (or ReplicaError) as replicas finish them (any order). Ray must be
    initialised by the caller (ray.init(...) or an existing cluster)."""
    try:
        import ray
    except ImportError as error:
        raise RuntimeError(RAY_MISSING) from error
    if not requests:
        return
    plan = plan_shards(requests, dp)
    rows = []
    for shard in range(plan.num_replicas):
        indices = plan.requests_of(shard)
        if indices.size:
            rows.append({"shard": shard, "payload": pickle.dumps([requests[i] for i in indices.tolist()])})
    dataset = ray.data.from_items(rows, override_num_blocks=len(rows))
    results = dataset.map_batches(
        EngineReplica, fn_constructor_args=(engine_config, dp.stream_every), batch_size=1, batch_format="numpy",
        concurrency=dp.num_replicas, num_gpus=dp.gpus_per_replica, num_cpus=dp.cpus_per_replica,
    )
    for batch in results.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=0):
        for payload in batch["payload"]:
            yield from pickle.loads(payload)


def generate_on_ray(engine_config, requests: Sequence, dp: RayDPConfig) -> list[object]:
    """Python helper: every request's FinishedOutput (or ReplicaError), in request order.
    requests: PreparedRequest with request_id = position in the list."""
    finished = {done.request_id: done for done in run_on_ray(engine_config, requests, dp)}
    return [finished[request.request_id] for request in requests]
