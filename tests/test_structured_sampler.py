"""The token bitmask in the sampler (engine/sampler.py): masked rows sample only allowed tokens,
other rows are untouched, logit bias applies before the mask, logprobs stay the model's and the
seeded noise is the same."""

from __future__ import annotations

import torch

from batchllm.engine.sampler import SamplingBatch, TokenBitmask, sample, sampling_row
from batchllm.sampling_params import SamplingParams

VOCAB = 70  # not a multiple of 32: the last word's high bits are past the vocabulary


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] bool -> [rows, ceil(vocab / 32)] int32 words (bit j of word w: token 32 w + j)."""
    num_words = -(-allowed.shape[1] // 32)
    padded = torch.zeros(allowed.shape[0], num_words * 32, dtype=torch.int64)
    padded[:, :allowed.shape[1]] = allowed.to(torch.int64)
    words = (padded.view(allowed.shape[0], num_words, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _mask_reference(logits: torch.Tensor, rows: list[int], allowed: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for index, row in enumerate(rows):
        for token in range(logits.shape[1]):
            if not allowed[index, token]:
                out[row, token] = float("-inf")
    return out


def _bitmask(rows: list[int], allowed: torch.Tensor) -> TokenBitmask:
    return TokenBitmask(torch.tensor(rows, dtype=torch.int64), _pack(allowed))


def _batch(params: list[SamplingParams]) -> SamplingBatch:
    return SamplingBatch.build([sampling_row(p, seed=7 + i, output_index=3) for i, p in enumerate(params)],
                               torch.device("cpu"))


def test_apply_masks_the_listed_rows_like_the_reference_and_leaves_the_others():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, VOCAB, generator=generator)
    allowed = torch.rand(2, VOCAB, generator=generator) < 0.3
    allowed[:, 69] = True  # the last token of the vocabulary (bit 5 of the third word)
    masked = _bitmask([3, 1], allowed).apply(logits)
    assert torch.equal(masked, _mask_reference(logits, [3, 1], allowed))
    for row in (0, 2, 4):
        assert torch.equal(masked[row], logits[row])
    assert masked[3, 69] == logits[3, 69] and masked[1, 69] == logits[1, 69]
    every = torch.rand(5, VOCAB, generator=generator) < 0.5
    every_row = TokenBitmask(torch.arange(5), _pack(every), every_row=True).apply(logits)
    assert torch.equal(every_row, _mask_reference(logits, list(range(5)), every))
    assert torch.equal(every_row, _bitmask(list(range(5)), every).apply(logits))


def test_greedy_and_sampled_rows_pick_only_allowed_tokens_and_free_rows_are_unchanged():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(4, VOCAB, generator=generator) * 3
    allowed = torch.zeros(2, VOCAB, dtype=torch.bool)
    allowed[0, [5, 40, 66]] = True
    allowed[1, [1, 2, 33, 64]] = True
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, top_k=3)]
    free = sample(logits, _batch(params)).token_ids
    constrained = sample(logits, _batch(params), _bitmask([0, 2], allowed)).token_ids
    assert constrained[0] == int(torch.tensor([5, 40, 66])[logits[0, [5, 40, 66]].argmax()])
    assert int(constrained[2]) in (1, 2, 33, 64)
    assert constrained[1] == free[1] and constrained[3] == free[3]
    # a masked row whose mask allows every token samples what it samples without one (same noise)
    everything = torch.ones(2, VOCAB, dtype=torch.bool)
    assert torch.equal(sample(logits, _batch(params), _bitmask([2, 3], everything)).token_ids, free)


def test_seeded_sampling_within_the_mask_is_the_race_over_the_allowed_tokens():
    """The masked row's token is the exponential race restricted to the allowed tokens, with the
    noise of its (seed, index): the noise does not depend on the mask."""
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(1, VOCAB, generator=generator)
    allowed = torch.rand(1, VOCAB, generator=generator) < 0.5
    batch = _batch([SamplingParams(temperature=0.8)])
    token = int(sample(logits, batch, _bitmask([0], allowed)).token_ids[0])
    restricted = logits.masked_fill(~allowed, float("-inf"))
    assert token == int(sample(restricted, batch).token_ids[0])
    assert allowed[0, token]


def test_logit_bias_applies_before_the_mask_and_logprobs_stay_the_models():
    logits = torch.zeros(1, VOCAB)
    logits[0, 10] = 5.0
    allowed = torch.zeros(1, VOCAB, dtype=torch.bool)
    allowed[0, [20, 30]] = True
    # the bias lifts a disallowed token (still masked) and an allowed one (now the top allowed)
    params = SamplingParams(temperature=0, logprobs=2, logit_bias={10: 50, 2: 80, 30: 10})
    out = sample(logits, _batch([params]), _bitmask([0], allowed))
    assert int(out.token_ids[0]) == 30
    model_logprobs = torch.log_softmax(logits, dim=-1)
    assert torch.equal(out.logprobs, model_logprobs[:, 30])
    assert out.top_token_ids[0, 0] == 10 and torch.equal(out.top_logprobs[0, :1], model_logprobs[0, 10:11])
