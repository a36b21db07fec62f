"""The engine: load once, then run batches through the step loop (engine/step_loop.py)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from batchllm.config import EngineConfig
from batchllm.engine.loading import EngineParts, load_parts
from batchllm.engine.request_state import FinishedOutput, PreparedRequest, RequestState, RunStats
from batchllm.engine.run_options import RunOptions
from batchllm.engine.sampler import mix_seed
from batchllm.engine.step_loop import StepLoop
from batchllm.engine.stop_checker import StopChecker
from batchllm.engine.request_limits import InvalidRequestError, RequestLimits
from batchllm.sampling_params import SamplingParams
from batchllm.sched.config import SchedulerConfig
from batchllm.sched.factory import make_scheduler
from batchllm.structured.errors import StructuredOutputError

if TYPE_CHECKING:  # xgrammar loads only for structured outputs
    from batchllm.structured.backend import GrammarBackend

__all__ = ["FinishedOutput", "LLMEngine", "PreparedRequest", "RunStats"]


class LLMEngine:
    """The Engine (and LocalEngine) of one device (engine/engine_protocol.py)."""

    def __init__(self, config: EngineConfig, parts: EngineParts | None = None) -> None:
        """parts: what the engine runs on; None loads the model on one device (load_parts). Build
        engines with batchllm.engines.build_engine, which picks the kind the config asks for."""
        from batchllm.models.tokenizer import load_tokenizer

        if parts is None and (config.parallel.tensor.size > 1 or config.parallel.ray is not None):
            raise ValueError("this configuration asks for tensor or data parallelism: build its engine with "
                             "batchllm.engines.build_engine")
        parts = parts if parts is not None else load_parts(config)
        self.config = config
        self.device, self.dtype = parts.device, parts.dtype
        self.arch, self.model_name = parts.arch, parts.model_name
        self.kv_cache, self.runner = parts.kv_cache, parts.runner
        self.max_model_len = parts.max_model_len
        self.tokenizer = load_tokenizer(parts.tokenizer_source)
        eos = set(parts.arch.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        # The KV blocks the scheduler may fill: the cache's, found when it was sized (state, not
        # configuration; set lower, the scheduler fills only part of the cache).
        self.num_kv_blocks = parts.kv_cache.num_blocks
        # Structured outputs' grammars over the tokenizer's vocabulary, built at the first request
        # that has one (grammar_backend); set it to compile over another vocabulary.
        self.grammars: GrammarBackend | None = None

    @property
    def scheduler_config(self) -> SchedulerConfig:
        """The scheduling settings of the next run: the configuration's, with the KV blocks."""
        return dataclasses.replace(self.config.scheduler, num_kv_blocks=self.num_kv_blocks)

    def configure_scheduler(self, **changes) -> None:
        """Change scheduling settings between runs (policy, token budget, ...): a new frozen
        configuration; the model and the KV cache stay as they are."""
        if "num_kv_blocks" in changes or "block_size" in changes:
            raise ValueError("num_kv_blocks and block_size belong to the KV cache the engine holds; "
                             "they change with a new engine")
        scheduler = dataclasses.replace(self.config.scheduler, **changes)
        self.config = dataclasses.replace(self.config, scheduler=scheduler)

    @property
    def limits(self) -> RequestLimits:
        """What one request may hold, under the current scheduler settings."""
        config = self.scheduler_config
        return RequestLimits(self.max_model_len, config.num_kv_blocks, config.block_size, self.arch.vocab_size,
                             config.kv_memory_threshold)

    @property
    def num_kv_tokens(self) -> int:
        return self.kv_cache.num_blocks * self.config.scheduler.block_size

    def grammar_backend(self) -> GrammarBackend:
        """Compiles structured outputs over the tokenizer's vocabulary (built on first use)."""
        if self.grammars is None:
            if self.tokenizer is None:
                raise StructuredOutputError(f"model {self.model_name} has no tokenizer: structured outputs need "
                                            "its vocabulary (use a .gguf file or a HF model directory)")
            from batchllm.structured.backend import GrammarBackend
            from batchllm.structured.vocabulary import GrammarVocabulary

            vocabulary = self.tokenizer.vocabulary
            self.grammars = GrammarBackend(GrammarVocabulary.from_token_bytes(
                vocabulary.token_bytes, vocabulary.skipped_ids, self.arch.vocab_size, self.eos_token_ids))
        return self.grammars

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """Refuse a structured output that cannot run (StructuredOutputError: a schema, regex or
        grammar that does not parse, a model without a tokenizer) and start compiling its grammar,
        so that it is ready when its request runs."""
        if params.structured_outputs is not None:
            self.grammar_backend().submit(params.structured_outputs)

    def shutdown(self) -> None:
        """Nothing outside this process to release."""

    def run(
        self,
        requests: list[PreparedRequest],
        on_step: Callable[[int, int], None] | None = None,
        stats: RunStats | None = None,
        options: RunOptions | None = None,
    ) -> Iterator[FinishedOutput]:
        """Run a batch of checked requests (RequestLimits.check); yields each request as it
        finishes. on_step(num_finished_now, num_new_tokens) after every step."""
        options = options if options is not None else RunOptions()
        stats = stats if stats is not None else RunStats()
        scheduler = make_scheduler(self.scheduler_config)
        states = {request.request_id: self._request_state(request) for request in requests}
        stats.num_requests += len(requests)
        stats.num_prompt_tokens += sum(len(request.prompt_token_ids) for request in requests)
        scheduler.add_requests([states[request.request_id].sched_request() for request in requests])
        asynchronous = options.async_scheduling and self.config.async_scheduling
        if options.cuda_graphs:  # graphs for a token budget raised since start-up, before the first step
            self.runner.ensure_step_capacity(self.scheduler_config.max_num_batched_tokens)
        loop = StepLoop(scheduler, self.runner, states, depth=1 if asynchronous else 0,
                        allow_graph=options.cuda_graphs, stats=stats, on_step=on_step,
                        bitmask_filler=self.grammars.filler if self.grammars is not None else None)
        started = time.perf_counter()
        yield from loop.run()
        stats.seconds += time.perf_counter() - started

    def _request_state(self, request: PreparedRequest) -> RequestState:
        params = request.params
        if params.max_tokens is None:
            raise InvalidRequestError(f"request {request.request_id} has no max_tokens: check it with "
                                      "engine.limits.check(prompt_token_ids, params) first")
        seed = params.seed if params.seed is not None else mix_seed(self.config.seed, request.request_id)
        decode = self._decode if params.skip_special_tokens else self._decode_with_special_tokens
        stop = StopChecker(params, params.max_tokens, self.eos_token_ids, decode)
        state = RequestState(request, stop, seed, [] if params.logprobs is not None else None)
        if params.structured_outputs is not None:
            try:  # its grammar compiles in the background until its first sampled row needs it
                state.grammar = self.grammar_backend().grammar_state(params.structured_outputs)
            except StructuredOutputError as error:  # refused: this request ends at its first step
                state.error, state.finish_reason = str(error), "error"
        return state

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    def _decode_with_special_tokens(self, token_ids: list[int]) -> str:
        """skip_special_tokens=False: special tokens stay in the text."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=False) if self.tokenizer is not None else ""
