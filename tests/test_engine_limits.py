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


def test_a_numpy_prompt_is_judged_as_its_list():
    import numpy as np
    import pytest

    from batchllm.engine.request_limits import InvalidTokenIdError, PromptTooLongError, RequestLimits

    limits = RequestLimits(max_model_len=64, num_kv_blocks=8, block_size=16, vocab_size=512)
    params = SamplingParams(max_tokens=100)
    for prompt in ([5, 511, 0], list(range(40))):
        assert limits.check(np.asarray(prompt), params) == limits.check(prompt, params)
    for prompt, error in (([5, 512], r"token id 512, outside"), ([-1, 5], r"token id -1, outside"),
                          (list(range(64)), "prompt has 64 tokens")):
        with pytest.raises(InvalidTokenIdError if "token id" in error else PromptTooLongError, match=error):
            limits.check(np.asarray(prompt, dtype=np.int64), params)
        with pytest.raises(InvalidTokenIdError if "token id" in error else PromptTooLongError, match=error):
            limits.check(prompt, params)


def test_generate_converts_each_prompt_once_and_hands_the_array_to_the_planner(monkeypatch):
    import numpy as np

    from batchllm.prefix import planner

    llm = LLM(model="random:tiny?vocab_size=512", device="cpu", kv_cache_tokens=512, dtype="float32")
    planned = []
    original = planner.plan_prefix_token_arrays

    def spy(prompts):
        planned.append(list(prompts))
        return original(prompts)

    # the policy imports the planner's function when it plans, so the spy sees every call
    monkeypatch.setattr(planner, "plan_prefix_token_arrays", spy)
    prefix = list(range(10, 30))
    as_lists = [prefix + [100 + i, 7] for i in range(3)] + [[40, 41, 42]]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    from_lists = llm.generate(as_lists, params, use_tqdm=False)
    from_arrays = llm.generate([np.asarray(p, dtype=np.int32) for p in as_lists], params, use_tqdm=False)
    # every prompt reached the planner as one integer array holding its ids
    assert len(planned) == 2
    for prompts in planned:
        assert [type(p) for p in prompts] == [np.ndarray] * 4
        assert [p.tolist() for p in prompts] == as_lists
    # numpy prompts come back as lists of Python ints, with the same outputs
    for a, b in zip(from_lists, from_arrays):
        assert b.prompt_token_ids == a.prompt_token_ids and type(b.prompt_token_ids[0]) is int
        assert b.outputs[0].token_ids == a.outputs[0].token_ids


def test_a_prompt_of_floats_is_refused_not_truncated():
    import pytest

    from batchllm.prefix.keys import PromptError

    llm = LLM(model="random:tiny?vocab_size=512", device="cpu", kv_cache_tokens=512, dtype="float32")
    with pytest.raises(PromptError, match="token ids must be integers"):
        llm.generate([[5, 6.5, 7]], SamplingParams(max_tokens=2), use_tqdm=False)


def test_token_id_array_holds_integer_ids_and_refuses_the_rest():
    import numpy as np

    from batchllm.engine.request_limits import token_id_array

    ids = token_id_array([5, 0, 2**40, True])
    assert ids.dtype == np.int64 and ids.tolist() == [5, 0, 2**40, 1]
    assert token_id_array(np.asarray([3, 4], dtype=np.int32)).tolist() == [3, 4]
    for refused in ([], [1.5, 2], [2**70], ["7"], [None]):
        assert token_id_array(refused) is None


def test_token_id_array_copies_an_integer_numpy_prompt_and_converts_the_rest_by_value():
    import numpy as np

    from batchllm.engine.request_limits import token_id_array

    for dtype in (np.int16, np.int32, np.int64, np.uint16, np.uint32):
        source = np.asarray([9, 0, 7], dtype=dtype)
        ids = token_id_array(source)
        source[0] = 1  # the engine's array is its own
        assert ids.dtype == np.int64 and ids.tolist() == [9, 0, 7]
    assert token_id_array(np.asarray([2**63 - 1], dtype=np.uint64)).tolist() == [2**63 - 1]
    assert token_id_array(np.asarray([2**63], dtype=np.uint64)) is None  # past int64: refused, not wrapped
    assert token_id_array(np.asarray([1.5, 2.0])) is None  # floats are refused, not truncated
    assert token_id_array(np.zeros(0, dtype=np.int32)) is None


def test_generate_refuses_a_numpy_prompt_of_floats():
    import numpy as np
    import pytest

    from batchllm.prefix.keys import PromptError

    llm = LLM(model="random:tiny?vocab_size=512", device="cpu", kv_cache_tokens=512, dtype="float32")
    with pytest.raises(PromptError, match="token ids must be integers"):
        llm.generate([np.asarray([5.0, 6.5, 7.0])], SamplingParams(max_tokens=2), use_tqdm=False)
