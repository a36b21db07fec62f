"""Sampler: greedy, filters, and seeded reproducibility independent of the batch."""

import torch

from batchllm.engine.sampler import SamplingBatch, sample, uniform_noise


def _row(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, seed=0, index=0, logprobs=None, logit_bias=None):
    return (temperature, top_p, top_k, min_p, seed, index, logprobs, logit_bias)


def test_greedy_is_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    out = sample(logits, SamplingBatch.build([_row(temperature=0.0)] * 4, torch.device("cpu")))
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_seeded_sampling_does_not_depend_on_batch_neighbours():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 100, generator=gen)
    alone = sample(logits[1:2], SamplingBatch.build([_row(seed=42, index=5)], torch.device("cpu"))).token_ids
    batch = SamplingBatch.build([_row(seed=1), _row(seed=42, index=5), _row(temperature=0.0)], torch.device("cpu"))
    together = sample(logits, batch).token_ids
    assert together[1] == alone[0]
    assert together[2] == logits[2].argmax()


def test_seeds_give_the_expected_distribution():
    # Over many seeds, frequencies follow softmax(logits / T).
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    num = 4000
    rows = [_row(temperature=1.0, seed=s) for s in range(num)]
    ids = sample(logits.expand(num, 4).contiguous(), SamplingBatch.build(rows, torch.device("cpu"))).token_ids
    freq = torch.bincount(ids, minlength=4).float() / num
    assert torch.allclose(freq, logits.softmax(-1)[0], atol=0.03)


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.tensor([[3.0, 2.9, 0.0, -5.0, -6.0]]).expand(300, 5).contiguous()
    device = torch.device("cpu")
    top_k = sample(logits, SamplingBatch.build([_row(top_k=2, seed=s) for s in range(300)], device)).token_ids
    assert set(top_k.tolist()) == {0, 1}
    top_p = sample(logits, SamplingBatch.build([_row(top_p=0.5, seed=s) for s in range(300)], device)).token_ids
    assert set(top_p.tolist()) == {0}
    min_p = sample(logits, SamplingBatch.build([_row(min_p=0.5, seed=s) for s in range(300)], device)).token_ids
    assert set(min_p.tolist()) == {0, 1}


def test_uniform_noise_range_and_determinism():
    u1 = uniform_noise(torch.tensor([7, 8]), torch.tensor([0, 3]), 1000)
    u2 = uniform_noise(torch.tensor([7, 8]), torch.tensor([0, 3]), 1000)
    assert torch.equal(u1, u2)
    assert u1.min() > 0 and u1.max() < 1
    assert not torch.equal(u1[0], u1[1])
    assert abs(u1.mean().item() - 0.5) < 0.03


def test_logprobs_are_returned():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    out = sample(logits, SamplingBatch.build([_row(temperature=0.0, logprobs=2)], torch.device("cpu")))
    expected = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs, expected[:, 2])
    assert out.top_token_ids.tolist() == [[2, 1]]


def test_temperatures_below_the_greedy_threshold_are_greedy_and_none_gives_nan():
    # Regression: logits / 1e-38 overflowed to inf, the softmax gave NaN and token 0 won every step.
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(3)) * 10
    logits[0, 0] = -50.0  # token 0 is the least likely: a NaN row would pick it
    top = int(logits.argmax())
    for temperature in (1e-45, 1e-38, 1e-20, 9.9e-6):
        batch = SamplingBatch.build([_row(temperature=temperature, seed=7)], torch.device("cpu"))
        assert batch.all_greedy and batch.temperature.tolist() == [0.0]
        assert sample(logits, batch).token_ids.tolist() == [top]
    for temperature in (1e-5, 1e-4):  # divided by: the top token's probability rounds to 1
        batch = SamplingBatch.build([_row(temperature=temperature, seed=s) for s in range(20)], torch.device("cpu"))
        assert not batch.all_greedy
        assert sample(logits.expand(20, -1).contiguous(), batch).token_ids.tolist() == [top] * 20


def test_extreme_logits_at_a_small_temperature_sample_a_finite_distribution():
    logits = torch.tensor([[2.9e38, -3.0e38, 3.0e38, 0.0]])  # NaN rows would give token 0
    rows = [_row(temperature=1e-3, seed=s) for s in range(10)]
    out = sample(logits.expand(10, -1).contiguous(), SamplingBatch.build(rows, torch.device("cpu")))
    assert out.token_ids.tolist() == [2] * 10


def test_a_token_of_probability_zero_is_never_sampled_when_its_noise_rounds_to_one():
    # Seed 485's uniform for token 15203 at output index 0 rounds to 1.0 in float32 (its bits are
    # within 128 of 2^32): its exponential was 0 and 0 / 0 made that filtered token win.
    seed, token, vocab_size = 485, 15203, 50000
    assert uniform_noise(torch.tensor([seed]), torch.tensor([0]), vocab_size)[0, token] < 1
    logits = torch.zeros(1, vocab_size)
    logits[0, 7] = 5.0  # the one token top_k=1 keeps
    out = sample(logits, SamplingBatch.build([_row(top_k=1, seed=seed)], torch.device("cpu"))).token_ids
    assert out.tolist() == [7]


def test_model_dtype_logits_sample_as_their_float32_widening():
    # The runner hands the LM head's bf16 logits to the sampler: plain greedy rows take their argmax
    # as they are, every other batch is widened first, so each matches the float32 path exactly.
    logits = (torch.randn(6, 50, generator=torch.Generator().manual_seed(3)) * 4).to(torch.bfloat16)
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # a tie: the first index wins either way
    device = torch.device("cpu")
    batches = [[_row(temperature=0.0)] * 6, [_row(temperature=0.0, logprobs=3)] * 6,
               [_row(seed=s) for s in range(6)], [_row(top_k=3, top_p=0.8, seed=s) for s in range(6)]]
    for rows in batches:
        narrow = sample(logits, SamplingBatch.build(rows, device))
        wide = sample(logits.float(), SamplingBatch.build(rows, device))
        assert narrow.token_ids.dtype == torch.int64
        assert torch.equal(narrow.token_ids, wide.token_ids)
        assert narrow.logprobs is None or torch.equal(narrow.logprobs, wide.logprobs)
    assert sample(logits, SamplingBatch.build(batches[0], device)).token_ids[0] == 7
