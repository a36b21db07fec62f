"""What a seed guarantees (README, "Input and output"): the noise is a function of (seed, output
index, vocab id) only, so a seeded request samples the same tokens whatever its neighbours
sample as long as its logits are the same bits, which holds for the same batch shapes; another
schedule changes the logits by float rounding only."""

import pytest
import torch

import batchllm.engine.model_runner as model_runner
from batchllm.engine.llm_engine import PreparedRequest
from batchllm.sampling_params import SamplingParams

pytest_plugins = ["model_fixtures"]

PROMPTS = [[5 + i, 6, 7, 8 + i, 9, 10 + 2 * i] for i in range(4)]
TARGET = SamplingParams(temperature=0.8, seed=11, max_tokens=12, ignore_eos=True)
SMALL_STEPS = {"policy": "vllm", "max_num_batched_tokens": 8, "max_num_seqs": 3}


def _run(engine, params_list, **schedule):
    engine.configure_scheduler(**schedule)
    requests = [PreparedRequest(i, prompt, engine.limits.check(prompt, params))
                for i, (prompt, params) in enumerate(zip(PROMPTS, params_list))]
    return {done.request_id: done.output_token_ids for done in engine.run(requests)}


def test_a_seeded_request_does_not_depend_on_what_its_neighbours_sample(tiny_engine):
    # Neighbours with ignore_eos and max_tokens keep every step's shape, whatever they sample.
    greedy = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 3
    sampled = [SamplingParams(temperature=1.5, top_k=5, seed=s, max_tokens=12, ignore_eos=True) for s in range(3)]
    with_greedy = _run(tiny_engine, [TARGET, *greedy], **SMALL_STEPS)
    with_sampled = _run(tiny_engine, [TARGET, *sampled], **SMALL_STEPS)
    assert [with_greedy[i] != with_sampled[i] for i in (1, 2, 3)] == [True] * 3
    assert with_greedy[0] == with_sampled[0] == [465, 167, 43, 72, 243, 13, 505, 412, 42, 371, 409, 336]
    assert _run(tiny_engine, [TARGET, *greedy], **SMALL_STEPS) == with_greedy  # same schedule: same answers


def test_another_schedule_changes_the_logits_by_rounding_only(tiny_engine, monkeypatch):
    """One step of 2048 tokens or chunked prefill at 8 tokens a step with at most 3 sequences: the
    target's logits (until its tokens first differ) agree to float rounding, never more."""
    logits_by_schedule = []
    sample = model_runner.sample

    def spy(logits, batch, *rest):
        for row in range(logits.shape[0]):
            if int(batch.seeds[row]) == TARGET.seed:
                captured[int(batch.output_index[row])] = logits[row].clone()
        return sample(logits, batch, *rest)

    monkeypatch.setattr(model_runner, "sample", spy)
    greedy = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 3
    tokens = []
    for schedule in ({"policy": "batchllm", "max_num_batched_tokens": 2048, "max_num_seqs": None}, SMALL_STEPS):
        captured = {}
        tokens.append(_run(tiny_engine, [TARGET, *greedy], **schedule)[0])
        logits_by_schedule.append(captured)
    same = next((i for i, (a, b) in enumerate(zip(*tokens)) if a != b), len(tokens[0]) - 1)
    for index in range(same + 1):
        first, second = logits_by_schedule[0][index], logits_by_schedule[1][index]
        assert torch.allclose(first, second, rtol=0, atol=1e-4), (index, (first - second).abs().max())


@pytest.mark.parametrize("num_rows", [1, 5])
def test_a_seeded_row_samples_the_same_token_in_any_row_of_any_batch(num_rows):
    from batchllm.engine.sampler import SamplingBatch, sampling_row
    from batchllm.engine.sampler import sample as sample_rows

    logits = torch.randn(num_rows, 64, generator=torch.Generator().manual_seed(num_rows))
    rows = [sampling_row(SamplingParams(temperature=1.2, seed=100 + r), 100 + r, 3) for r in range(num_rows)]
    together = sample_rows(logits, SamplingBatch.build(rows, torch.device("cpu"))).token_ids.tolist()
    alone = [int(sample_rows(logits[r:r + 1], SamplingBatch.build([rows[r]], torch.device("cpu"))).token_ids[0])
             for r in range(num_rows)]
    assert together == alone
