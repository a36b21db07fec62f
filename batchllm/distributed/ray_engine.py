"""An Engine (engine/engine_protocol.py) backed by Ray replicas (`batchllm run --ray`).

The job itself is the single-process one, so a Ray run resumes like a local one and either can
resume the other's journal (docs/scale-out.md). Only the engine differs: the driver tokenizes and
checks lengths (against the replicas' limits) without loading any weights, and the replicas run
whole prefix groups (ray_dp). They live from engine load to the last window; a stop or a failure
kills them, and the next run starts new ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from batchllm.config import EngineConfig
from batchllm.distributed.ray_dp import kill_replicas, plan_shards, start_replicas, stream_shards
from batchllm.engine.request_limits import RequestLimits
from batchllm.engine.request_state import FinishedOutput, PreparedRequest, RunStats
from batchllm.engine.run_options import RunOptions
from batchllm.sampling_params import SamplingParams
from batchllm.structured.errors import StructuredOutputError


class RayEngine:
    """The Engine of config.parallel.ray: the driver holds the tokenizer and the requests'
    limits, the replicas each an LLMEngine."""

    def __init__(self, config: EngineConfig) -> None:
        """Starts the replicas and waits for their models: a replica that cannot load fails here."""
        import ray

        from batchllm.models.loader import describe_model
        from batchllm.models.tokenizer import load_tokenizer

        if config.parallel.ray is None:
            raise ValueError("a RayEngine needs config.parallel.ray (the data parallel settings)")
        description = describe_model(config.model)
        self.config, self.dp = config, config.parallel.ray
        self.arch, self.model_name = description.config, description.name
        self.tokenizer = load_tokenizer(description.tokenizer_source)
        self.replicas: list | None = start_replicas(config, self.dp)  # None after a stop or a failure
        # Requests are checked against the smallest replica KV cache (each replica checks again).
        try:
            replica_limits = ray.get([replica.limits.remote() for replica in self.replicas])
        except BaseException:
            self.shutdown()
            raise
        self.limits: RequestLimits = min(replica_limits, key=lambda limits: limits.token_limit)

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """The driver checks that the grammar parses; each replica compiles it for its run."""
        if params.structured_outputs is None:
            return
        if self.tokenizer is None:
            raise StructuredOutputError(f"model {self.model_name} has no tokenizer: structured outputs need "
                                        "its vocabulary (use a .gguf file or a HF model directory)")
        from batchllm.structured.grammars import build_grammar

        build_grammar(params.structured_outputs)

    def run(
        self,
        requests: list[PreparedRequest],
        on_step: Callable[[int, int], None] | None = None,
        stats: RunStats | None = None,
        options: RunOptions | None = None,
    ) -> Iterator[FinishedOutput]:
        """Yields each request as a replica finishes it (a request a replica rejected comes back as
        a FinishedOutput with `error` set). on_step(num_finished, num_new_tokens) after each update,
        at least every stop_poll_s, so that the caller can stop by raising there. options: every
        replica runs its shards with them."""
        stats = stats if stats is not None else RunStats()
        stats.num_requests += len(requests)
        stats.num_prompt_tokens += sum(len(request.prompt_token_ids) for request in requests)
        if not requests:
            return
        started = time.perf_counter()
        if self.replicas is None:
            self.replicas = start_replicas(self.config, self.dp)
        try:
            shards = plan_shards(requests, self.dp)
            for update in stream_shards(self.replicas, shards, self.dp.stop_poll_s, options):
                stats.num_steps += update.num_steps
                stats.num_output_tokens += update.num_new_tokens
                yield from update.finished
                if on_step is not None:
                    on_step(len(update.finished), update.num_new_tokens)
        except BaseException:  # a stop, a failure or an abandoned run: the replicas may be mid-shard
            self.shutdown()
            raise
        finally:
            stats.seconds += time.perf_counter() - started

    def shutdown(self) -> None:
        """Kill the replicas (a later run starts new ones)."""
        if self.replicas is not None:
            kill_replicas(self.replicas)
            self.replicas = None

