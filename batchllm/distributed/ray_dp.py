"""Data parallelism on Ray actors (optional extra: pip install 'batchllm[ray]').

The driver plans prefix groups over the WHOLE batch and assigns whole groups to shards
(dp_plan); one actor per replica holds an LLMEngine and runs one shard at a time as a Ray
streaming generator that yields after every engine step that finished a request, so results
reach the driver as they finish. Why: docs/scale-out.md ("Data parallelism on Ray").
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from batchllm.config import EngineConfig, ParallelConfig, RayDPConfig
from batchllm.distributed.dp_plan import plan_replicas

RAY_MISSING = "Ray is not installed: pip install 'batchllm[ray]'"
DEFAULT_COST_MAX_TOKENS = 256  # decode tokens assumed for cost when a request has no max_tokens


@dataclass(frozen=True)
class ShardUpdate:
    """What one replica sends after an engine step that finished requests."""

    finished: list  # FinishedOutput, `error` set for a request the replica could not run
    num_steps: int  # engine steps since the previous update
    num_new_tokens: int  # tokens generated since the previous update
    finished_at_s: float  # time.time() when the step ended on the replica


class EngineReplica:
    """A Ray actor: one LLMEngine; run_shard streams one shard's results step by step."""

    def __init__(self, engine_config: EngineConfig) -> None:
        """engine_config: the replica's own engine (one process, no Ray)."""
        from batchllm.engine.llm_engine import LLMEngine

        self.engine = LLMEngine(engine_config)

    def limits(self):
        """This replica's RequestLimits (its context and KV cache)."""
        return self.engine.limits

    def run_shard(self, requests: list, options=None) -> Iterator[ShardUpdate]:
        """The engine runs in a thread: an update is complete in its on_step callback (after each
        step's finished requests), and a callback cannot yield."""
        from batchllm.engine.request_state import FinishedOutput
        from batchllm.engine.request_limits import InvalidRequestError

        runnable, finished = [], []
        for request in requests:  # this replica's KV cache may be smaller than the driver assumed
            try:
                params = self.engine.limits.check(request.prompt_token_ids, request.params)
                runnable.append(dataclasses.replace(request, params=params))
            except InvalidRequestError as error:
                finished.append(FinishedOutput(request.request_id, [], [], "", "error", error=str(error)))
        updates: queue.Queue = queue.Queue()
        counts = [0, 0]  # steps, new tokens since the last update

        def on_step(num_finished: int, num_new_tokens: int) -> None:
            counts[0], counts[1] = counts[0] + 1, counts[1] + num_new_tokens
            if finished:
                updates.put(ShardUpdate(finished.copy(), counts[0], counts[1], time.time()))
                finished.clear()
                counts[:] = [0, 0]

        def run() -> None:
            try:
                for done in self.engine.run(runnable, on_step=on_step, options=options):
                    finished.append(done)
                if finished:  # rejected requests, and no step ran
                    updates.put(ShardUpdate(finished, 0, 0, time.time()))
                updates.put(None)
            except BaseException as error:  # re-raised below, where Ray reports it to the driver
                updates.put(error)

        threading.Thread(target=run, daemon=True).start()
        while (update := updates.get()) is not None:
            if isinstance(update, BaseException):
                raise update
            yield update


def plan_shards(requests: Sequence, dp: RayDPConfig) -> list[list]:
    """PreparedRequests -> global plan, whole groups to num_replicas * shards_per_replica shards;
    the non-empty shards, costliest first (handed out in this order: longest processing time first)."""
    prompts = [request.prompt_token_ids for request in requests]
    max_tokens = [DEFAULT_COST_MAX_TOKENS if request.params.max_tokens is None else request.params.max_tokens
                  for request in requests]
    plan = plan_replicas(prompts, max_tokens, dp.num_replicas * dp.shards_per_replica, dp.decode_token_weight)
    costliest_first = (-plan.replica_cost_tokens).argsort(kind="stable")
    shards = [plan.requests_of(shard).tolist() for shard in costliest_first]
    return [[requests[i] for i in shard] for shard in shards if shard]


def replica_gpus(engine_config: EngineConfig, dp: RayDPConfig) -> float:
    """GPUs each replica asks Ray for: dp.gpus_per_replica, or (None) 1 when the engine's device
    is CUDA, else 0."""
    if dp.gpus_per_replica is not None:
        return dp.gpus_per_replica
    from batchllm.engine.loading import resolve_device

    return 1.0 if resolve_device(engine_config.device).type == "cuda" else 0.0


def start_replicas(engine_config: EngineConfig, dp: RayDPConfig) -> list:
    """num_replicas actors on the connected Ray cluster (each loads the model when it starts);
    each replica's engine is engine_config in one process."""
    import ray

    actor = ray.remote(EngineReplica).options(num_gpus=replica_gpus(engine_config, dp), num_cpus=dp.cpus_per_replica)
    replica_config = dataclasses.replace(engine_config, parallel=ParallelConfig())
    return [actor.remote(replica_config) for _ in range(dp.num_replicas)]


def stream_shards(replicas: list, shards: list[list], stop_poll_s: float, options=None) -> Iterator[ShardUpdate]:
    """Runs the shards on the replicas (an idle replica takes the next shard) and yields every
    update as it arrives, or an empty one after stop_poll_s with nothing arriving (a chance to stop).
    options: the RunOptions every replica runs its shards with (None: the defaults)."""
    import ray

    waiting = deque(shards)
    running: dict = {}  # ObjectRefGenerator -> its replica

    def start(replica) -> None:
        if waiting:
            running[replica.run_shard.remote(waiting.popleft(), options)] = replica

    for replica in replicas:
        start(replica)
    while running:
        ready, _ = ray.wait(list(running), num_returns=1, timeout=stop_poll_s)
        if not ready:
            yield ShardUpdate([], 0, 0, time.time())
        for generator in ready:
            try:
                ref = next(generator)
            except StopIteration:
                start(running.pop(generator))
                continue
            yield ray.get(ref)


def kill_replicas(replicas: list) -> None:
    import ray

    for replica in replicas:
        ray.kill(replica)


def generate_on_ray(engine_config: EngineConfig, requests: Sequence, dp: RayDPConfig) -> list[object]:
    """Python helper: every request's FinishedOutput (or ReplicaError), in request order.
    requests: PreparedRequest with request_id = position in the list. Ray must be initialised by
    the caller (ray.init(...) or an existing cluster)."""
    replicas = start_replicas(engine_config, dp)
    try:
        updates = stream_shards(replicas, plan_shards(requests, dp), dp.stop_poll_s)
        finished = {done.request_id: done for update in updates for done in update.finished}
    finally:
        kill_replicas(replicas)
    return [finished[request.request_id] for request in requests]
