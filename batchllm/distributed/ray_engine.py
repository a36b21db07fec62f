"""The batch job's engine interface, backed by Ray replicas (`batchllm run --ray`).

The job itself is the single-process one, so a Ray run resumes like a local one and either can
resume the other's journal (docs/scale-out.md). Only the engine differs: the driver tokenizes and
checks lengths without loading any weights, and the replicas run whole prefix groups (run_on_ray).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from batchllm.config import EngineConfig
from batchllm.distributed.ray_dp import RayDPConfig, ReplicaError, run_on_ray
from batchllm.engine.loading import model_len_limit
from batchllm.engine.request_state import FinishedOutput, PreparedRequest, RunStats
from batchllm.request_limits import RequestLimits


class RayEngine:
    """Duck-types the parts of LLMEngine that the batch job uses (run, limits, tokenizer)."""

    def __init__(self, config: EngineConfig, dp: RayDPConfig) -> None:
        from batchllm.models.loader import describe_model
        from batchllm.tokenizer import load_tokenizer

        description = describe_model(config.model)
        self.config, self.dp = config, dp
        self.arch, self.model_name = description.config, description.name
        self.tokenizer = load_tokenizer(description.tokenizer_source)
        max_model_len = model_len_limit(config, self.arch)
        # The driver cannot see a replica's free GPU memory: it checks against the configured KV
        # size (or the context); a replica whose cache is smaller answers that request with an error.
        kv_tokens = config.kv_cache_tokens or max_model_len
        block_size = config.scheduler.block_size
        self.limits = RequestLimits(max_model_len, -(-kv_tokens // block_size), block_size, self.arch.vocab_size,
                                    config.scheduler.kv_memory_threshold)

    def run(
        self,
        requests: list[PreparedRequest],
        on_step: Callable[[int, int], None] | None = None,
        stats: RunStats | None = None,
    ) -> Iterator[FinishedOutput]:
        """Yields each request as a replica finishes it; a request a replica rejected comes back
        as a FinishedOutput with `error` set."""
        stats = stats if stats is not None else RunStats()
        stats.num_requests += len(requests)
        stats.num_prompt_tokens += sum(len(request.prompt_token_ids) for request in requests)
        started = time.perf_counter()
        for done in run_on_ray(self.config, requests, self.dp):
            if isinstance(done, ReplicaError):
                done = FinishedOutput(done.request_id, [], [], "", "error", error=done.message)
            stats.num_output_tokens += len(done.output_token_ids)
            yield done
            if on_step is not None:
                on_step(1, len(done.output_token_ids))
        stats.seconds += time.perf_counter() - started
