"""Asynchronous scheduling (step N+1 scheduled before step N's tokens reach the host) gives
exactly the outputs of one-step-at-a-time scheduling: tokens, finish reasons, text, logprobs,
under every policy, with early stops (stop ids, stop strings, EOS), seeded sampling and
preemption."""

import dataclasses

import pytest
import torch

from batchllm.config import EngineConfig
from batchllm.engine.llm_engine import LLMEngine, PreparedRequest, RunStats
from batchllm.engine.placeholders import (
    has_placeholders,
    placeholder_for_row,
    placeholder_source,
    resolve_placeholders_,
)
from batchllm.sampling_params import SamplingParams
from batchllm.sched.config import SchedulerConfig

pytest_plugins = ["model_fixtures"]

POLICIES = ["batchllm", "vllm", "sglang", "simple"]


@pytest.fixture(scope="module")
def tiny_engine():
    config = EngineConfig(model="random:tiny", dtype="float32", device="cpu", kv_cache_tokens=4096)
    return LLMEngine(config)


def _requests(num_requests: int, stop_ids: dict[int, list[int]]) -> list[PreparedRequest]:
    requests = []
    for i in range(num_requests):
        document = [10 + (i % 3)] * 40 + list(range(100, 100 + (i % 3) * 5))  # 3 prefix groups
        prompt = document + [200 + i, 300 + (i * 7) % 50, 400 + i % 11]
        params = SamplingParams(temperature=0.0 if i % 2 else 0.8, max_tokens=6 + i % 9, ignore_eos=True,
                                stop_token_ids=stop_ids.get(i, []), logprobs=2 if i % 4 == 0 else None, seed=i)
        requests.append(PreparedRequest(i, prompt, params))
    return requests


def _run(engine: LLMEngine, requests, async_scheduling: bool, stats=None, **scheduler_changes):
    engine.async_scheduling = async_scheduling
    engine.configure_scheduler(**scheduler_changes)
    outputs = {out.request_id: out for out in engine.run(requests, stats=stats)}
    assert sorted(outputs) == [r.request_id for r in requests]
    return outputs


def _same(a, b):
    for request_id in a:
        x, y = a[request_id], b[request_id]
        assert x.output_token_ids == y.output_token_ids, request_id
        assert x.finish_reason == y.finish_reason, request_id
        assert x.text == y.text
        if x.logprobs is None:
            assert y.logprobs is None
        else:
            assert len(x.logprobs) == len(x.output_token_ids)
            assert [sorted(e) for e in x.logprobs] == [sorted(e) for e in y.logprobs]
            for ex, ey in zip(x.logprobs, y.logprobs):
                for token_id in ex:
                    assert ex[token_id] == pytest.approx(ey[token_id], abs=1e-5)


@pytest.mark.parametrize("policy", POLICIES)
def test_async_equals_sync_with_early_stops(tiny_engine, policy):
    plain = _requests(24, {})
    reference = _run(tiny_engine, plain, False, policy=policy, max_num_batched_tokens=64)
    # Stop ids taken from the sync run's own outputs: these requests stop early, mid-flight.
    stop_ids = {}
    for i in range(0, 24, 3):
        ids = reference[i].output_token_ids
        if len(ids) > 3:
            stop_ids[i] = [ids[2]]
    requests = _requests(24, stop_ids)
    sync = _run(tiny_engine, requests, False, policy=policy, max_num_batched_tokens=64)
    early = [i for i in stop_ids if sync[i].finish_reason == "stop"]
    assert len(early) >= 4 and all(len(sync[i].output_token_ids) <= 3 for i in early)
    asynchronous = _run(tiny_engine, requests, True, policy=policy, max_num_batched_tokens=64)
    _same(sync, asynchronous)


def test_async_equals_sync_under_preemption(tiny_engine):
    # vllm policy with a KV cache too small for everyone: recompute preemption of requests whose
    # newest token may still be a placeholder.
    requests = _requests(24, {})
    small = dict(policy="vllm", max_num_batched_tokens=64, num_kv_blocks=24)
    engine = tiny_engine
    saved = engine.scheduler_config
    stats = {False: RunStats(), True: RunStats()}
    try:
        sync_stats_outputs = _run(engine, requests, False, stats[False], **small)
        asynchronous = _run(engine, requests, True, stats[True], **small)
    finally:
        engine.scheduler_config = saved
    for mode, run_stats in stats.items():
        assert sum(r.num_preempted_requests for r in run_stats.step_records) > 0, f"async={mode}: no preemption"
    _same(sync_stats_outputs, asynchronous)


def test_async_counts_steps_and_tokens(tiny_engine):
    from batchllm.engine.llm_engine import RunStats

    requests = _requests(8, {})
    totals = {}
    for mode in (False, True):
        tiny_engine.async_scheduling = mode
        tiny_engine.configure_scheduler(policy="batchllm", max_num_batched_tokens=64)
        stats = RunStats()
        outs = list(tiny_engine.run(requests, stats=stats))
        totals[mode] = (stats.num_steps, stats.num_output_tokens, sum(len(o.output_token_ids) for o in outs),
                        len(stats.step_records))
    assert totals[True] == totals[False]
    assert totals[True][1] == totals[True][2]


def test_stop_strings_and_eos_async_equals_sync(default_llm):
    prompts = ["1, 2, 3, 4, 5,", "Say hello.", "The capital of France is", "a b c d e f"]
    params = [SamplingParams(temperature=0, max_tokens=20, stop=[" 8"]),
              SamplingParams(temperature=0, max_tokens=24),
              SamplingParams(temperature=0, max_tokens=16, stop=["."], include_stop_str_in_output=True),
              SamplingParams(temperature=0.7, max_tokens=12, seed=5, logprobs=1)]
    llm = default_llm
    llm.engine.async_scheduling = False
    sync = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.async_scheduling = True
    asynchronous = llm.generate(prompts, params, use_tqdm=False)
    assert sync[0].outputs[0].finish_reason == "stop" and sync[0].outputs[0].text == " 6, 7,"
    for x, y in zip(sync, asynchronous):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].text == y.outputs[0].text
        assert x.outputs[0].finish_reason == y.outputs[0].finish_reason


def test_placeholders_resolve_on_device():
    ids = torch.tensor([5, placeholder_for_row(2), 7, placeholder_for_row(0)])
    resolve_placeholders_(ids, torch.tensor([11, 12, 13]))
    assert ids.tolist() == [5, 13, 7, 11]
    import numpy as np

    assert has_placeholders(np.array([3, -1])) and not has_placeholders(np.array([0, 4]))
    with pytest.raises(ValueError, match="previous step"):
        resolve_placeholders_(torch.tensor([-1]), None)
    previous = torch.tensor([11])
    assert placeholder_source(np.array([3, 4]), None) is None
    assert placeholder_source(np.array([3, 4]), previous) is None
    assert placeholder_source(np.array([3, -1]), previous) is previous
    with pytest.raises(ValueError, match="previous step"):
        placeholder_source(np.array([3, -1]), None)


def test_config_default_is_async():
    assert EngineConfig().async_scheduling is True
    assert dataclasses.replace(EngineConfig(), async_scheduling=False).async_scheduling is False
    assert SchedulerConfig().policy == "batchllm"
