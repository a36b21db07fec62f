"""The host-cost tool drives the real step loop with its fake runner: every request runs to its
max_tokens, and each part of the step is timed."""

from batchllm.perf.host_cost import PARTS, measure


def test_host_cost_runs_the_step_loop_to_the_end():
    result = measure("uniform:128:128", 40, 2048, 60000, "batchllm", None)
    assert result["output_tokens"] == 40 * 128
    assert result["steps"] >= 128
    assert set(PARTS) <= set(result["ms_per_step"])
    assert result["ms_per_step"]["total"] > 0
