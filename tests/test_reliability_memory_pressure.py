"""With a tiny KV budget (--kv-cache-tokens 256) long generations complete through
preemption/recompute (vllm, sglang) or memory-aware admission (batchllm), and the greedy
outputs equal the unconstrained run token for token, under every policy."""

import numpy as np
import pytest

from batchllm.config import engine_config
from batchllm.engine.llm_engine import LLMEngine, PreparedRequest, RunStats
from batchllm.sampling_params import SamplingParams
from batchllm.sched.block_table import BlockTableTracker

pytest_plugins = ["model_fixtures"]

SMALL_KV_TOKENS = 256
MAX_TOKENS = 32
NUM_REQUESTS = 8  # 8 x (12 + 32) tokens > 256


@pytest.fixture
def engines(tiny_engine):
    """The session's random:tiny engine (4096 KV tokens: nothing is ever preempted) and one whose
    KV cache holds less than the requests need. Preemption and recompute do not depend on the
    weights, so the tiny model keeps the many small steps of this test cheap."""
    return tiny_engine, LLMEngine(engine_config("random:tiny", dtype="float32", device="cpu",
                                               kv_cache_tokens=SMALL_KV_TOKENS))


def _requests(engine):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [PreparedRequest(i, [5 + i, 40 + 3 * i] + [100 + (7 * i + j) % 300 for j in range(10)], params)
            for i in range(NUM_REQUESTS)]


def _run(engine, policy, requests):
    engine.configure_scheduler(policy=policy)
    stats = RunStats()
    outputs = {done.request_id: done.output_token_ids for done in engine.run(requests, stats=stats)}
    return outputs, stats


class _TableCheck:
    """Wraps the runner's input building: every step's gathered block tables must equal the
    whole tables rebuilt from the scheduler's changes, zero-padded."""

    def __init__(self, runner) -> None:
        self.runner, self.build = runner, runner.step_inputs
        self.tracker, self.num_steps = BlockTableTracker(), 0

    def __call__(self, output):
        inputs = self.build(output)
        tables = self.tracker.apply(output)
        expected = np.zeros((len(tables), max(1, max(map(len, tables)))), dtype=np.int32)
        for row, table in enumerate(tables):
            expected[row, :len(table)] = table
        assert np.array_equal(inputs.block_tables, expected), output.step_index
        self.num_steps += 1
        return inputs


def test_tiny_kv_budget_gives_the_unconstrained_outputs_under_every_policy(engines):
    big, small = engines
    requests = _requests(big)
    assert sum(len(r.prompt_token_ids) + MAX_TOKENS for r in requests) > SMALL_KV_TOKENS
    reference, _ = _run(big, "batchllm", requests)
    assert len({tuple(v) for v in reference.values()}) == NUM_REQUESTS  # real, distinct generations
    assert small.num_kv_tokens == SMALL_KV_TOKENS
    for policy in ("batchllm", "vllm", "sglang"):
        check = small.runner.step_inputs = _TableCheck(small.runner)
        try:
            outputs, stats = _run(small, policy, requests)
        finally:
            del small.runner.step_inputs
        assert check.num_steps == len(stats.step_records), policy
        assert outputs == reference, policy
        assert max(r.num_used_blocks for r in stats.step_records) <= SMALL_KV_TOKENS // 16, policy
        preempted = sum(r.num_preempted_requests for r in stats.step_records)
        if policy == "batchllm":
            assert preempted == 0  # admits by full-length KV need (BatchLLM 4.3.3): never has to preempt
        else:
            assert preempted > 0, policy  # memory ran out mid-run: preempted and recomputed
