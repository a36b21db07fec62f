"""ModelRunner.observer: called around every step's launch, told how the step ran (eagerly on the
CPU, or through the uncaptured pieces of the piecewise graphs), also when the launch raises; None
by default."""

import pytest

from batchllm.engine.request_state import PreparedRequest, RunStats
from batchllm.sampling_params import SamplingParams

pytest_plugins = ["model_fixtures"]  # tiny_engine


class Recorder:
    def __init__(self):
        self.calls = []

    def step_started(self, output):
        self.calls.append(("started", output.step_index))

    def step_launched(self, output, mode):
        self.calls.append(("launched", output.step_index, mode))


def _requests(num_requests: int, max_tokens: int) -> list[PreparedRequest]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [PreparedRequest(i, [5, 6, 7, 8, 9 + i], params) for i in range(num_requests)]


def test_observer_sees_every_step_in_order(tiny_engine):
    runner = tiny_engine.runner
    assert runner.observer is None
    recorder, stats = Recorder(), RunStats()
    runner.observer = recorder
    try:
        outputs = list(tiny_engine.run(_requests(4, max_tokens=3), stats=stats))
    finally:
        runner.observer = None
    assert sorted(len(o.output_token_ids) for o in outputs) == [3, 3, 3, 3]
    # the prompts in one step, then one decode step per further token
    assert recorder.calls == [("started", 0), ("launched", 0, "eager"), ("started", 1), ("launched", 1, "eager"),
                              ("started", 2), ("launched", 2, "eager")]
    assert stats.num_steps == 3


def test_observer_hears_a_failed_launch(tiny_engine, monkeypatch):
    runner = tiny_engine.runner
    recorder = Recorder()

    def broken(*args, **kwargs):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(runner, "_execute", broken)
    runner.observer = recorder
    try:
        with pytest.raises(RuntimeError, match="launch failed"):
            list(tiny_engine.run(_requests(1, max_tokens=2)))
    finally:
        runner.observer = None
    assert recorder.calls == [("started", 0), ("launched", 0, "eager")]
