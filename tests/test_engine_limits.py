"""Regression: a request clamped to the KV cache must still fit when its group prefix does not end
on a block boundary (the prefix's last block is shared, the member's tokens start a new block)."""

from batchllm import LLM, SamplingParams


def test_clamped_requests_fit_with_an_unaligned_shared_prefix():
    llm = LLM(model="random:tiny?vocab_size=512", device="cpu", kv_cache_tokens=64, policy="batchllm")
    prefix = list(range(10, 31))  # 21 tokens: ends inside the second block of 16
    prompts = [prefix + [100 + i] * 9 for i in range(2)]  # 30 tokens each
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)
    limit = llm.engine.limits.token_limit
    assert limit == 48  # 4 blocks less the one a shared prefix split can cost
    assert [len(o.outputs[0].token_ids) for o in outputs] == [limit - 30, limit - 30]
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)


def test_logit_bias_and_stop_token_ids_outside_the_vocabulary_are_refused():
    import pytest

    from batchllm.engine.request_limits import InvalidTokenIdError, RequestLimits

    limits = RequestLimits(max_model_len=64, num_kv_blocks=8, block_size=16, vocab_size=512)
    assert limits.check([5], SamplingParams(logit_bias={"511": 5}, stop_token_ids=[511])).max_tokens == 16
    with pytest.raises(InvalidTokenIdError, match=r"logit_bias names token id 512, outside the vocabulary"):
        limits.check([5], SamplingParams(logit_bias={"512": 5}))
    with pytest.raises(InvalidTokenIdError, match=r"stop_token_ids names token id 600, outside the vocabulary"):
        limits.check([5], SamplingParams(stop_token_ids=[600]))
