"""Tensor-parallel engine: one process per GPU on one host; this process is rank 0
(docs/scale-out.md). batchllm.engines.build_engine builds it for config.parallel.tensor.size > 1.

A script that builds a TPEngine must guard its top level with `if __name__ == "__main__":`
(spawned workers import the main module).
"""

from __future__ import annotations

import datetime
import itertools
import os
import queue
import sys
import traceback
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from batchllm.config import EngineConfig
from batchllm.distributed.sharding import LoadedShard, load_shard
from batchllm.distributed.step_gate import RunAborted, StepGate, new_shared_words
from batchllm.distributed.tp_runner import TPModelRunner
from batchllm.engine.kv_cache import KVCache, choose_num_kv_tokens, kv_bytes_per_token
from batchllm.engine.llm_engine import LLMEngine
from batchllm.engine.request_state import FinishedOutput, PreparedRequest, RunStats
from batchllm.engine.run_options import RunOptions
from batchllm.engine.loading import (
    EngineParts, activation_reserve_bytes, model_len_limit, prepare_model, resolve_device, resolve_dtype,
)


def rendezvous_store(rank: int, port: int | None, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The group's store on 127.0.0.1. Rank 0's listens before any worker starts, on `port` or on
    one the OS picks (a port found free and bound only later can be taken in between: EADDRINUSE);
    its .port is the one the workers' stores connect to."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        return dist.TCPStore("127.0.0.1", port or 0, world_size, is_master=True, timeout=timeout,
                             wait_for_workers=False)
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    device = resolve_device(config.device)
    if device.type == "cuda":
        if rank >= torch.cuda.device_count():
            raise RuntimeError(f"tensor parallel rank {rank} needs GPU {rank}; {torch.cuda.device_count()} visible")
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return device


@dataclass
class RankState:
    """What one rank holds after start-up."""

    device: torch.device
    dtype: torch.dtype
    shard: LoadedShard
    kv_cache: KVCache
    max_model_len: int
    control_group: object  # None: the default group (gloo)


def start_rank(config: EngineConfig, rank: int, store: dist.Store) -> RankState:
    """Every rank, in the same order: join the group through its store (rendezvous_store), load
    the shard, agree on the KV size."""
    tp = config.parallel.tensor
    world_size = tp.size
    device = rank_device(config, rank)
    dtype = resolve_dtype(config.dtype, device)
    backend = tp.resolve_backend(device.type)
    timeout = datetime.timedelta(seconds=tp.timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    control_group = None if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    shard = load_shard(config.model, dtype, device, rank, world_size, group=None)
    full, local = shard.layout.full, shard.layout.shard
    max_model_len = model_len_limit(config, full)
    prepare_model(shard.model, config, max_model_len, device)
    # The same reserve as LLMEngine, on the full widths (conservative for a shard).
    reserve = activation_reserve_bytes(config, full, dtype)
    bytes_per_token = kv_bytes_per_token(local.num_layers, local.num_kv_heads, local.head_dim, dtype)
    num_kv_tokens = choose_num_kv_tokens(device, bytes_per_token, config.cache, reserve)
    # Every rank schedules the same steps: all must hold the same number of blocks (the smallest).
    agreed = torch.tensor([num_kv_tokens], dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=control_group)
    num_blocks = max(1, int(agreed.item()) // config.scheduler.block_size)
    kv_cache = KVCache.allocate(local.num_layers, num_blocks, config.scheduler.block_size, local.num_kv_heads,
                                local.head_dim, dtype, device)
    return RankState(device, dtype, shard, kv_cache, max_model_len, control_group)


def make_runner(state: RankState, config: EngineConfig, gate: StepGate) -> TPModelRunner:
    return TPModelRunner(state.shard.model, state.shard.layout.shard, state.kv_cache,
                         config.scheduler.block_size, state.device, config.attention_backend,
                         cuda_graphs=not config.enforce_eager,
                         max_num_tokens=config.scheduler.max_num_batched_tokens, gate=gate)


def engine_parts(state: RankState, runner: TPModelRunner) -> EngineParts:
    return EngineParts(state.device, state.dtype, state.shard.layout.full, state.shard.name,
                       state.shard.tokenizer_source, state.max_model_len, state.kv_cache, runner)


@dataclass(frozen=True)
class RunCommand:
    """Rank 0 -> each worker, once per run: what to run and with which settings (rank 0's
    configuration and KV blocks, so that every rank schedules the same steps)."""

    run_id: int
    requests: list[PreparedRequest]
    config: EngineConfig
    num_kv_blocks: int
    options: RunOptions


def _next_command(commands, poll_s: float = 1.0) -> RunCommand | None:
    """The next run, or None to stop (also when rank 0 has died without saying so)."""
    parent = os.getppid()
    while True:
        try:
            return commands.get(timeout=poll_s)
        except queue.Empty:
            if os.getppid() != parent:
                return None


def _worker_main(rank: int, port: int, config: EngineConfig, gate_words, commands) -> None:
    try:
        timeout_s = config.parallel.tensor.timeout_s
        state = start_rank(config, rank, rendezvous_store(rank, port, config.parallel.tensor.size, timeout_s))
        runner = make_runner(state, config, StepGate(gate_words, leader=False, timeout_s=timeout_s))
        engine = LLMEngine(config, engine_parts(state, runner))
        while (command := _next_command(commands)) is not None:
            engine.config, engine.num_kv_blocks = command.config, command.num_kv_blocks
            runner.run_id = command.run_id
            try:
                for _ in engine.run(command.requests, options=command.options):
                    pass
            except RunAborted:
                pass  # rank 0 ended this run early; it launched no step after ours
        runner.release_cuda_graphs()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report, then die loudly so rank 0 times out
        print(f"tensor parallel worker rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise


def _stop(gate: StepGate, runner: TPModelRunner, commands: list, processes: list, timeout_s: float) -> None:
    """Tell the workers to stop, leave the process group with them, wait for them (idempotent).
    Every rank destroys its CUDA graphs, then leaves the group at the same time as the others:
    NCCL's teardown waits for all ranks, and for graphs that captured its collectives."""
    if dist.is_initialized():
        gate.stop()
        try:
            for channel in commands:
                channel.put(None)
            runner.release_cuda_graphs()
            dist.destroy_process_group()
        finally:
            for process in processes:
                process.join(timeout=timeout_s)
                if process.is_alive():
                    process.terminate()


class TPEngine(LLMEngine):
    """LLMEngine whose model is split over tensor_parallel_size processes (this one is rank 0).
    Every rank runs the same step loop; rank 0 alone yields the outputs."""

    def __init__(self, config: EngineConfig) -> None:
        """config.parallel.tensor: how many processes, their backend and rendezvous."""
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group already exists in this process: "
                               "one TPEngine per process")
        tp = config.parallel.tensor
        store = rendezvous_store(0, tp.master_port, tp.size, tp.timeout_s)
        port = store.port
        context = mp.get_context("spawn")
        gate_words = new_shared_words(context)
        self._commands = [context.Queue() for _ in range(1, tp.size)]
        self._workers = [context.Process(target=_worker_main, args=(rank, port, config, gate_words, channel),
                                         daemon=True, name=f"batchllm-tp-rank{rank}")
                         for rank, channel in enumerate(self._commands, start=1)]
        for process in self._workers:
            process.start()
        state = start_rank(config, 0, store)
        self.gate = StepGate(gate_words, leader=True, timeout_s=tp.timeout_s)
        super().__init__(config, engine_parts(state, make_runner(state, config, self.gate)))
        self._run_ids = itertools.count()
        self._finalizer = weakref.finalize(self, _stop, self.gate, self.runner, self._commands, self._workers, 60.0)

    def run(
        self,
        requests: list[PreparedRequest],
        on_step: Callable[[int, int], None] | None = None,
        stats: RunStats | None = None,
        options: RunOptions | None = None,
    ) -> Iterator[FinishedOutput]:
        """LLMEngine.run on every rank: the workers get the batch once, then no per-step message."""
        self.runner.raise_if_broken()  # before the workers get a run they could not finish
        options = options if options is not None else RunOptions()
        run_id = next(self._run_ids)
        command = RunCommand(run_id, list(requests), self.config, self.num_kv_blocks, options)
        for channel in self._commands:
            channel.put(command)
        self.runner.run_id = run_id
        try:
            yield from super().run(requests, on_step, stats, options)
        finally:
            self.gate.end_run(run_id)

    def shutdown(self) -> None:
        """Stop the workers and leave the process group (also runs at exit)."""
        self._finalizer()

    def __enter__(self) -> "TPEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
