"""Tensor parallelism on two GPUs (NCCL): decode steps replay whole-step CUDA graphs and the other
steps piecewise graphs, with the all-reduces captured in them, the step loop runs ahead
(asynchronous scheduling) on every rank and gives the synchronous loop's tokens, and the engine
shuts down promptly. (That the shards compute the unsharded model is pinned exactly in float32 on
CPU, tests/test_distributed_tp.py.)"""

import time

import pytest
import torch

from batchllm.config import ParallelConfig, TensorParallelConfig, engine_config
from batchllm.engine.llm_engine import PreparedRequest
from batchllm.engine.run_options import RunOptions
from batchllm.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


def _requests() -> list[PreparedRequest]:
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(1000, 30000, (300,), generator=generator).tolist()
    requests = []
    for i in range(24):
        prompt = prefix + torch.randint(1000, 30000, (20 + i,), generator=generator).tolist()
        params = SamplingParams(max_tokens=12 + i % 5, temperature=0.0 if i % 2 else 1.0, seed=7 + i, ignore_eos=True)
        requests.append(PreparedRequest(i, prompt, params))
    return requests


def test_tp2_graphs_and_async_scheduling():
    import dataclasses

    from batchllm.engines import build_engine

    config = engine_config("random:qwen2.5-14b?num_layers=2", dtype="bfloat16", kv_cache_tokens=32768)
    tensor = TensorParallelConfig(size=2, timeout_s=300)
    engine = build_engine(dataclasses.replace(config, parallel=ParallelConfig(tensor=tensor)))
    runs = {}
    for name, options in (("async", RunOptions()), ("sync", RunOptions(async_scheduling=False))):
        before = engine.runner.graph_counts()
        runs[name] = {o.request_id: o.output_token_ids for o in engine.run(_requests(), options=options)}
        after = engine.runner.graph_counts()
        assert after["graph_replays"] > before["graph_replays"]  # decode steps ran as graphs, all-reduces inside
        assert after["piecewise_steps"] > before["piecewise_steps"]  # and prefill steps as piecewise graphs
        assert after["eager_steps"] == before["eager_steps"]
    started = time.perf_counter()
    engine.shutdown()
    assert time.perf_counter() - started < 30  # graphs destroyed first, then every rank leaves together
    assert runs["async"] == runs["sync"]
    assert [len(runs["async"][r.request_id]) for r in _requests()] == [r.params.max_tokens for r in _requests()]
    assert len({tuple(t) for t in runs["async"].values()}) > 12  # the comparison is not trivial
