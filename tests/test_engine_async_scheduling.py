"""Asynchronous scheduling (step N+1 scheduled before step N's tokens reach the host) gives
exactly the outputs of one-step-at-a-time scheduling: tokens, finish reasons, text, logprobs,
under every policy, with early stops (stop ids, stop strings, EOS), seeded sampling and
preemption."""

import dataclasses

import pytest

from batchllm.config import EngineConfig, engine_config
from batchllm.engine.llm_engine import LLMEngine, PreparedRequest, RunStats
from batchllm.engine.run_options import RunOptions
from batchllm.sampling_params import SamplingParams
from batchllm.sched.config import SchedulerConfig

pytest_plugins = ["model_fixtures"]

POLICIES = ["batchllm", "vllm", "sglang", "simple"]


@pytest.fixture(scope="module")
def tiny_engine():
    config = engine_config("random:tiny", dtype="float32", device="cpu", kv_cache_tokens=4096)
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


def _run(engine: LLMEngine, requests, async_scheduling: bool, stats: RunStats | None = None, **scheduler_changes):
    engine.configure_scheduler(**scheduler_changes)
    options = RunOptions(async_scheduling=async_scheduling)
    outputs = {out.request_id: out for out in engine.run(requests, stats=stats, options=options)}
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
    # newest token was sampled by the step before.
    requests = _requests(24, {})
    small = dict(policy="vllm", max_num_batched_tokens=64)
    num_kv_blocks = tiny_engine.num_kv_blocks
    tiny_engine.num_kv_blocks = 24  # the scheduler fills 24 of the cache's blocks
    stats = {False: RunStats(), True: RunStats()}
    try:
        sync = _run(tiny_engine, requests, False, stats[False], **small)
        asynchronous = _run(tiny_engine, requests, True, stats[True], **small)
    finally:
        tiny_engine.num_kv_blocks = num_kv_blocks
    for mode in (False, True):
        assert sum(r.num_preempted_requests for r in stats[mode].step_records) > 0, mode
    _same(sync, asynchronous)
    # The same steps: the scheduler counts an unread token as it counts a read one.
    steps = {mode: [(r.num_decode_tokens, r.num_distinct_tokens, r.num_prefix_tokens, r.num_used_blocks,
                     r.num_preempted_requests) for r in stats[mode].step_records] for mode in (False, True)}
    assert steps[False] == steps[True]


def test_async_counts_steps_and_tokens(tiny_engine):
    requests = _requests(8, {})
    totals = {}
    for mode in (False, True):
        tiny_engine.configure_scheduler(policy="batchllm", max_num_batched_tokens=64)
        stats = RunStats()
        outs = list(tiny_engine.run(requests, stats=stats, options=RunOptions(async_scheduling=mode)))
        totals[mode] = (stats.num_steps, stats.num_output_tokens, sum(len(o.output_token_ids) for o in outs),
                        len(stats.step_records))
    assert totals[True] == totals[False]
    assert totals[True][1] == totals[True][2]


def test_stop_strings_and_eos_async_equals_sync(default_llm):
    prompts = ["1, 2, 3, 4, 5,", "Say hello.", "The capital of France is", "a b c d e f"]
    params = [SamplingParams(temperature=0, max_tokens=20, stop=[" 8"]),
              SamplingParams(temperature=0, max_tokens=24),
              SamplingParams(temperature=0, max_tokens=16, stop=["."], include_stop_str_in_output=True),
              SamplingParams(temperature=0.7, max_tokens=8, seed=5, logprobs=1)]
    llm = default_llm
    sync = llm.generate(prompts, params, use_tqdm=False, options=RunOptions(async_scheduling=False))
    asynchronous = llm.generate(prompts, params, use_tqdm=False, options=RunOptions(async_scheduling=True))
    assert sync[0].outputs[0].finish_reason == "stop" and sync[0].outputs[0].text == " 6, 7,"
    assert sync[1].outputs[0].finish_reason == "stop" and len(sync[1].outputs[0].token_ids) < 24  # EOS
    for x, y in zip(sync, asynchronous):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].text == y.outputs[0].text
        assert x.outputs[0].finish_reason == y.outputs[0].finish_reason


def test_config_default_is_async():
    assert EngineConfig().async_scheduling is True
    assert dataclasses.replace(EngineConfig(), async_scheduling=False).async_scheduling is False
    assert SchedulerConfig().policy == "batchllm"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failing_request_ends_alone_with_an_error(tiny_engine, monkeypatch, async_scheduling):
    """A Python exception in one request's host work (here: the stop check of request 5 at its
    third token, the final text of request 7) finishes that request with an error and frees its
    blocks; every other request runs to the same output as without the failures. Request 5 has a
    stop string (that never matches), so its tokens go through its StopChecker one at a time."""
    from batchllm.engine.stop_checker import StopChecker

    requests = _requests(12, {})
    reference = _run(tiny_engine, requests, async_scheduling, policy="vllm", max_num_batched_tokens=64)
    long_params = dataclasses.replace(requests[5].params, max_tokens=200, stop=("never printed",))
    requests[5] = PreparedRequest(5, requests[5].prompt_token_ids, long_params)
    original_check, original_text = StopChecker.check, StopChecker.final_text

    def check(self, output_token_ids):
        if self.params.seed == 5 and len(output_token_ids) == 3:
            raise RuntimeError("injected")
        return original_check(self, output_token_ids)

    def final_text(self, output_token_ids, finish_reason):
        if self.params.seed == 7:
            raise KeyError(7)
        return original_text(self, output_token_ids, finish_reason)

    monkeypatch.setattr(StopChecker, "check", check)
    monkeypatch.setattr(StopChecker, "final_text", final_text)
    stats = RunStats()
    outputs = _run(tiny_engine, requests, async_scheduling, stats, policy="vllm", max_num_batched_tokens=64)
    stopped, decoded = outputs.pop(5), outputs.pop(7)
    assert (stopped.finish_reason, stopped.error, stopped.text) == ("error", "internal_error: RuntimeError: injected", "")
    assert stopped.output_token_ids == reference[5].output_token_ids[:3]
    assert stats.num_steps < 100  # finished at once, its blocks freed: nobody waits for its 200 tokens
    assert (decoded.finish_reason, decoded.error) == ("error", "internal_error: KeyError: 7")
    assert decoded.output_token_ids == reference[7].output_token_ids
    _same({i: reference[i] for i in outputs}, outputs)


def test_run_options_reach_the_runner(tiny_engine, monkeypatch):
    calls = []
    execute = tiny_engine.runner.execute

    def spy(output, rows, allow_graph=True, **kwargs):
        calls.append(allow_graph)
        return execute(output, rows, allow_graph=allow_graph, **kwargs)

    monkeypatch.setattr(tiny_engine.runner, "execute", spy)
    requests = _requests(4, {})
    tiny_engine.configure_scheduler(policy="batchllm", max_num_batched_tokens=64)
    list(tiny_engine.run(requests, options=RunOptions(cuda_graphs=False, async_scheduling=False)))
    assert calls and not any(calls)
    calls.clear()
    list(tiny_engine.run(requests))
    assert calls and all(calls)


def test_unchecked_requests_are_refused(tiny_engine):
    from batchllm.engine.request_limits import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="limits.check"):
        list(tiny_engine.run([PreparedRequest(0, [5, 6], SamplingParams(max_tokens=None))]))
