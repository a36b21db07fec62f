"""The engine: load once, then run batches. The loop is schedule -> execute -> update."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from batchllm.config import EngineConfig
from batchllm.engine.kv_cache import KVCache, choose_num_kv_tokens, kv_bytes_per_token
from batchllm.engine.model_runner import ModelRunner, StepResult
from batchllm.engine.placeholders import placeholder_for_row
from batchllm.engine.sampler import sampling_row
from batchllm.engine.stop_checker import StopState
from batchllm.sampling_params import SamplingParams
from batchllm.sched.factory import make_scheduler
from batchllm.sched.interface import FinishedRequest, SchedRequest, SchedulerOutput
from batchllm.sched.trace import StepRecord

_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class PreparedRequest:
    """A tokenized, validated request ready to run."""

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class FinishedOutput:
    request_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[dict[int, float]] | None = None
    num_cached_prompt_tokens: int = 0
    error: str | None = None  # set when the request could not run (e.g. a Ray replica rejected it)


@dataclass
class RunStats:
    num_requests: int = 0
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    seconds: float = 0.0
    step_records: list[StepRecord] = field(default_factory=list)


@dataclass
class _Live:
    sched_request: SchedRequest
    params: SamplingParams
    stop: StopState
    seed: int
    logprobs: list[dict[int, float]] | None
    # Asynchronous scheduling: set once the request's last real token is known (the scheduler
    # may still hold one more, wasted, token after an EOS or stop-string stop).
    final_reason: str | None = None
    num_final_tokens: int = 0


@dataclass
class _InFlight:
    """A launched step whose sampled tokens have not reached the host yet."""

    output: SchedulerOutput
    result: StepResult
    schedule_time_s: float
    launch_time_s: float
    token_index: list[int] = field(default_factory=list)  # per sampled row: its index in the outputs


class RequestTooLongError(ValueError):
    pass


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def model_len_limit(config: EngineConfig, arch) -> int:
    limit = arch.max_position_embeddings
    return min(config.max_model_len or limit, limit)


def prepare_model(model, config: EngineConfig, max_model_len: int, device: torch.device) -> None:
    """Build the RoPE table once, up front (growing it later would need a device sync), and
    choose the fused layer kernels (on for CUDA unless the config says otherwise)."""
    model.rotary.ensure_capacity(max_model_len, device)
    model.fused_kernels = device.type == "cuda" if config.fused_kernels is None else config.fused_kernels


def activation_reserve_bytes(config: EngineConfig, arch, dtype: torch.dtype) -> int:
    """GPU memory kept out of the KV cache: activations of the largest step (hidden states,
    fused gate-up output), logits, the decode CUDA graphs' pools, and 1 GiB of slack."""
    element = torch.empty((), dtype=dtype).element_size()
    per_token = element * (8 * arch.hidden_size + 3 * arch.intermediate_size)
    reserve = config.scheduler.max_num_batched_tokens * per_token + 1024 * arch.vocab_size * 4 * 3 + (1 << 30)
    if not config.enforce_eager:
        reserve += 2048 * per_token * 4  # private pools of the graphs (one per token bucket)
    return reserve


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from batchllm.models.loader import load_model

        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        loaded = load_model(config.model, dtype=dtype, device=device)
        arch = loaded.config
        max_model_len = model_len_limit(config, arch)
        prepare_model(loaded.model, config, max_model_len, device)
        block_size = config.scheduler.block_size
        bytes_per_token = kv_bytes_per_token(arch.num_layers, arch.num_kv_heads, arch.head_dim, dtype)
        num_kv_tokens = choose_num_kv_tokens(device, bytes_per_token, config.kv_cache_tokens,
                                             config.gpu_memory_utilization,
                                             activation_reserve_bytes(config, arch, dtype))
        kv_cache = KVCache.allocate(arch.num_layers, max(1, num_kv_tokens // block_size), block_size,
                                    arch.num_kv_heads, arch.head_dim, dtype, device)
        runner = ModelRunner(loaded.model, arch, kv_cache, block_size, device, config.attention_backend,
                             cuda_graphs=not config.enforce_eager)
        self._attach(config, device, dtype, loaded.model, arch, loaded.name, loaded.tokenizer_source,
                     max_model_len, kv_cache, runner)

    def _attach(self, config: EngineConfig, device: torch.device, dtype: torch.dtype, model, arch, model_name: str,
                tokenizer_source, max_model_len: int, kv_cache: KVCache, runner: ModelRunner) -> None:
        """Set what `run` reads; shared with engines that build their parts differently (TP)."""
        from batchllm.tokenizer import load_tokenizer

        self.config, self.device, self.dtype = config, device, dtype
        self.model, self.arch, self.model_name = model, arch, model_name
        self.tokenizer = load_tokenizer(tokenizer_source)
        self.max_model_len = max_model_len
        eos = set(arch.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.kv_cache = kv_cache
        self.scheduler_config = dataclasses.replace(config.scheduler, num_kv_blocks=kv_cache.num_blocks,
                                                    max_model_len=max_model_len)
        self.runner = runner
        self.async_scheduling = config.async_scheduling

    def configure_scheduler(self, **changes) -> None:
        """Change scheduling settings between runs (policy, token budget, ...); the model and
        the KV cache stay as they are."""
        self.scheduler_config = dataclasses.replace(self.scheduler_config, **changes)

    @property
    def num_kv_tokens(self) -> int:
        return self.kv_cache.num_blocks * self.scheduler_config.block_size

    # -- request preparation --------------------------------------------------------------

    @property
    def token_limit(self) -> int:
        """Most tokens (prompt + generated) one request may use: the context, or the KV cache the
        scheduler may fill less one block (a shared prefix that does not end on a block boundary
        costs its members one extra block), whichever is smaller."""
        config = self.scheduler_config
        threshold = config.kv_memory_threshold or 1.0
        usable_blocks = max(1, int(threshold * config.num_kv_blocks)) - 1
        return min(self.max_model_len, max(1, usable_blocks) * config.block_size)

    def check_length(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Reject prompts that do not fit; clamp max_tokens to the token limit (documented)."""
        num_prompt_tokens = len(prompt_token_ids)
        if num_prompt_tokens == 0:
            raise RequestTooLongError("the prompt has no tokens")
        limit = self.token_limit
        room = limit - num_prompt_tokens
        if room < 1:
            raise RequestTooLongError(
                f"prompt has {num_prompt_tokens} tokens; the limit is {limit - 1} "
                f"(max model length {self.max_model_len}, KV cache {self.num_kv_tokens} tokens)"
            )
        if self.arch.vocab_size and max(prompt_token_ids) >= self.arch.vocab_size:
            raise RequestTooLongError(f"prompt holds token id {max(prompt_token_ids)} >= vocab size {self.arch.vocab_size}")
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        return params if max_tokens == params.max_tokens else dataclasses.replace(params, max_tokens=max_tokens)

    # -- the loop ---------------------------------------------------------------------------

    def run(
        self,
        requests: list[PreparedRequest],
        on_step: Callable[[int, int], None] | None = None,
        stats: RunStats | None = None,
    ) -> Iterator[FinishedOutput]:
        """Run a batch; yields each request as it finishes. on_step(num_finished_now, num_new_tokens)."""
        stats = stats if stats is not None else RunStats()
        scheduler = make_scheduler(self.scheduler_config)
        live: dict[int, _Live] = {}
        for request in requests:
            params = self.check_length(request.prompt_token_ids, request.params)
            seed = params.seed if params.seed is not None else _mix_seed(self.config.seed, request.request_id)
            sched_request = SchedRequest(request.request_id, list(request.prompt_token_ids), params.max_tokens)
            live[request.request_id] = _Live(
                sched_request, params, StopState(params, params.max_tokens, self.eos_token_ids), seed,
                [] if params.logprobs is not None else None,
            )
            stats.num_prompt_tokens += len(request.prompt_token_ids)
        stats.num_requests += len(requests)
        scheduler.add_requests([state.sched_request for state in live.values()])
        started = time.perf_counter()
        steps = self._steps_async if self.async_scheduling else self._steps_sync
        yield from steps(scheduler, live, on_step, stats)
        stats.seconds += time.perf_counter() - started

    def _steps_sync(self, scheduler, live: dict[int, _Live], on_step, stats: RunStats) -> Iterator[FinishedOutput]:
        """One step at a time: schedule, launch, wait for the tokens, update."""
        while scheduler.has_unfinished():
            step_started = time.perf_counter()
            output = self._schedule(scheduler)
            scheduled = time.perf_counter()
            rows = [self._sampling_row(live[c.seq_id]) for c in output.chunks if c.sample]
            result = self.runner.execute(output, rows)
            launched = time.perf_counter()
            token_ids = result.token_ids_list()  # the step's only device sync
            waited = time.perf_counter()
            sampled, finish_reasons = self._check_stops(result, token_ids, live)
            finished = scheduler.update(output, sampled, finish_reasons)
            stats.num_steps += 1
            stats.num_output_tokens += len(sampled)
            stats.step_records.append(dataclasses.replace(
                StepRecord.from_output(output, time.perf_counter() - step_started),
                schedule_time_s=scheduled - step_started, launch_time_s=launched - scheduled,
                wait_time_s=waited - launched,
            ))
            for done in finished:
                yield self._finish(live.pop(done.request_id), done, list(done.output_token_ids), done.finish_reason)
            if on_step is not None:
                on_step(len(finished), len(sampled))

    def _steps_async(self, scheduler, live: dict[int, _Live], on_step, stats: RunStats) -> Iterator[FinishedOutput]:
        """Schedule and launch step N+1 before waiting for step N's tokens, so the GPU never
        idles while the host updates, schedules and builds inputs. The scheduler sees
        placeholder ids for step N's tokens (resolved on the device, patched on the host once
        known); max_tokens finishes are known in advance, while a request that stops by EOS,
        stop id or stop string at step N is finished at the update of step N+1 (one wasted
        row, dropped from its output)."""
        inflight: _InFlight | None = None
        stopped: dict[int, str] = {}  # stopped early, not yet finished in the scheduler
        last_sync = time.perf_counter()
        while True:
            step_started = time.perf_counter()
            finished = self._update_ahead(scheduler, inflight, live, stopped) if inflight is not None else []
            launched = None
            if scheduler.has_unfinished():
                output = self._schedule(scheduler)
                scheduled = time.perf_counter()
                rows = [self._sampling_row(live[c.seq_id]) for c in output.chunks if c.sample]
                previous = inflight.result.sampled if inflight is not None else None
                result = self.runner.execute(output, rows, previous.token_ids if previous is not None else None)
                done_launching = time.perf_counter()
                launched = _InFlight(output, result, scheduled - step_started, done_launching - scheduled)
            if inflight is not None:
                waiting = time.perf_counter()
                token_ids = inflight.result.token_ids_list()  # the step's only device sync
                synced = time.perf_counter()
                num_new = self._apply_tokens(inflight, token_ids, live, stopped)
                stats.num_steps += 1
                stats.num_output_tokens += num_new
                stats.step_records.append(dataclasses.replace(
                    StepRecord.from_output(inflight.output, synced - last_sync),
                    schedule_time_s=inflight.schedule_time_s, launch_time_s=inflight.launch_time_s,
                    wait_time_s=synced - waiting,
                ))
                last_sync = synced
                for done in finished:
                    state = live.pop(done.request_id)
                    stopped.pop(done.request_id, None)
                    output_ids = state.sched_request.output_token_ids[:state.num_final_tokens]
                    yield self._finish(state, done, output_ids, state.final_reason)
                if on_step is not None:
                    on_step(len(finished), num_new)
            if launched is None:
                return
            inflight = launched

    def _schedule(self, scheduler) -> SchedulerOutput:
        output = scheduler.schedule()
        if output.is_empty:
            raise RuntimeError("the scheduler returned an empty step with requests left: a scheduler bug")
        return output

    def _update_ahead(self, scheduler, inflight: _InFlight, live: dict[int, _Live],
                      stopped: dict[int, str]) -> list[FinishedRequest]:
        """scheduler.update for a step whose tokens are still on the device: placeholders for
        the tokens; finish the requests that reach max_tokens with them and those that stopped
        at the step before (their row in this step is wasted)."""
        placeholders: dict[int, int] = {}
        reasons: dict[int, str] = {}
        for row, seq_id in enumerate(inflight.result.seq_ids):
            outputs = live[seq_id].sched_request.output_token_ids
            inflight.token_index.append(len(outputs))
            placeholders[seq_id] = placeholder_for_row(row)
            if len(outputs) + 1 >= live[seq_id].stop.max_tokens:
                reasons[seq_id] = "length"  # the real reason is set once the token is known
        if stopped:
            for chunk in inflight.output.chunks:
                if not chunk.is_prefix and chunk.seq_id in stopped:
                    reasons[chunk.seq_id] = stopped[chunk.seq_id]
        return scheduler.update(inflight.output, placeholders, reasons)

    def _apply_tokens(self, inflight: _InFlight, token_ids: list[int], live: dict[int, _Live],
                      stopped: dict[int, str]) -> int:
        """Patch the real tokens over the placeholders, record logprobs, run the stop checks.
        Returns the number of new (kept) tokens."""
        sampled = inflight.result.host_output()
        if sampled is None:
            return 0
        chosen, top_ids, top_values = _logprob_lists(sampled)
        num_new = 0
        for row, (seq_id, token_id) in enumerate(zip(inflight.result.seq_ids, token_ids)):
            state = live[seq_id]
            if state.final_reason is not None:
                continue  # the wasted row after an early stop
            index = inflight.token_index[row]
            outputs = state.sched_request.output_token_ids
            outputs[index] = token_id
            num_new += 1
            if state.logprobs is not None:
                state.logprobs.append(self._logprob_entry(state, row, token_id, chosen, top_ids, top_values))
            reason = state.stop.check(outputs if len(outputs) == index + 1 else outputs[:index + 1], token_id,
                                      self._decode)
            if reason is not None:
                state.final_reason, state.num_final_tokens = reason, index + 1
                if reason != "length":
                    stopped[seq_id] = reason
        return num_new

    @staticmethod
    def _logprob_entry(state: _Live, row: int, token_id: int, chosen, top_ids, top_values) -> dict[int, float]:
        entry = {token_id: chosen[row]}
        if top_ids is not None:
            k = state.params.logprobs
            entry.update(zip(top_ids[row][:k], top_values[row][:k]))
        return entry

    def _sampling_row(self, state: _Live) -> tuple:
        return sampling_row(state.params, state.seed, len(state.sched_request.output_token_ids))

    def _check_stops(self, result, token_ids: list[int], live: dict[int, _Live]) -> tuple[dict[int, int], dict[int, str]]:
        sampled: dict[int, int] = {}
        finish_reasons: dict[int, str] = {}
        output = result.host_output()
        if output is None:
            return sampled, finish_reasons
        chosen, top_ids, top_values = _logprob_lists(output)
        for row, (seq_id, token_id) in enumerate(zip(result.seq_ids, token_ids)):
            state = live[seq_id]
            sampled[seq_id] = token_id
            if state.logprobs is not None:
                state.logprobs.append(self._logprob_entry(state, row, token_id, chosen, top_ids, top_values))
            outputs = state.sched_request.output_token_ids + [token_id]
            reason = state.stop.check(outputs, token_id, self._decode)
            if reason is not None:
                finish_reasons[seq_id] = reason
        return sampled, finish_reasons

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    def _finish(self, state: _Live, done: FinishedRequest, output_ids: list[int], finish_reason: str) -> FinishedOutput:
        text_ids = state.stop.final_token_ids_for_text(output_ids, finish_reason)
        text = state.stop.final_text(self._decode(text_ids))
        return FinishedOutput(
            request_id=done.request_id,
            prompt_token_ids=state.sched_request.prompt_token_ids,
            output_token_ids=list(output_ids),
            text=text,
            finish_reason=finish_reason,
            logprobs=state.logprobs,
            num_cached_prompt_tokens=done.num_cached_prompt_tokens,
        )


def _logprob_lists(output) -> tuple:
    """(chosen logprobs, top ids, top logprobs) of a host SamplerOutput as lists (None if absent)."""
    return tuple(t.tolist() if t is not None else None
                 for t in (output.logprobs, output.top_token_ids, output.top_logprobs))


def _mix_seed(base_seed: int, request_id: int) -> int:
    return ((base_seed & _MASK32) * 0x9E3779B1 + request_id * 0x85EBCA6B + 0x27D4EB2F) & _MASK32
