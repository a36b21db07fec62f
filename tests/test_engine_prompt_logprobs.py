"""Prompt logprobs (vLLM's prompt_logprobs): each prompt position's log-softmax equals a plain
PyTorch forward over the whole prompt, however the prompt is chunked over steps, under every
policy, and a request that asks for them shares no prefix (its prefix positions must run)."""

import pytest
import torch

from batchllm.engine.request_state import PreparedRequest
from batchllm.sampling_params import SamplingParams
from model_helpers import run_flat

pytest_plugins = ["model_fixtures"]

PREFIX = [11 + (7 * i) % 200 for i in range(37)]
PROMPTS = [PREFIX + [300, 301, 302, 303], PREFIX + [310, 311], PREFIX + [320, 321, 322], [5, 6]]
NUM_TOP = 3


def _run(engine, prompt_logprobs):
    requests = [PreparedRequest(i, list(prompt), engine.limits.check(prompt, SamplingParams(
        temperature=0, max_tokens=4, prompt_logprobs=k))) for i, (prompt, k) in enumerate(zip(PROMPTS, prompt_logprobs))]
    return {done.request_id: done for done in engine.run(requests)}


def _reference(engine, prompt):
    """log_softmax of the model's logits over the whole prompt in one plain forward (fp32, CPU)."""
    (logits,) = run_flat(engine.runner.model, [prompt])
    return torch.log_softmax(logits.double(), dim=-1)


def _assert_matches(engine, done, num_top):
    prompt = done.prompt_token_ids
    reference = _reference(engine, prompt)
    entries = done.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None and done.prompt_token_ranks[0] is None
    for position in range(1, len(prompt)):
        row = reference[position - 1]
        top = torch.topk(row, num_top)
        entry = entries[position]
        assert list(entry)[0] == prompt[position]  # the prompt's token first, then the top tokens
        assert set(entry) == {prompt[position], *top.indices.tolist()}
        for token_id, logprob in entry.items():
            assert logprob == pytest.approx(float(row[token_id]), abs=1e-4), (position, token_id)
        assert done.prompt_token_ranks[position] == int((row > row[prompt[position]]).sum()) + 1


@pytest.mark.parametrize("policy", ["batchllm", "vllm", "sglang", "simple"])
def test_prompt_logprobs_equal_a_plain_forward_over_chunked_prompts(tiny_engine, policy):
    # 8 tokens a step: each 40-token prompt is prefilled over several steps
    tiny_engine.configure_scheduler(policy=policy, max_num_batched_tokens=8)
    plain = _run(tiny_engine, [None] * 4)
    asked = _run(tiny_engine, [NUM_TOP, None, 0, 1])
    for i in range(4):
        assert asked[i].output_token_ids == plain[i].output_token_ids  # greedy: the same tokens
    assert plain[1].prompt_logprobs is None and asked[1].prompt_logprobs is None
    _assert_matches(tiny_engine, asked[0], NUM_TOP)
    _assert_matches(tiny_engine, asked[2], 0)
    _assert_matches(tiny_engine, asked[3], 1)
    # A request with prompt logprobs reuses no KV (no shared prefix, no prefix-cache hit); the
    # others still share theirs.
    assert asked[0].num_cached_prompt_tokens == asked[2].num_cached_prompt_tokens == 0
    if policy != "simple":
        assert plain[1].num_cached_prompt_tokens + plain[2].num_cached_prompt_tokens > 0


def test_prompt_logprobs_through_the_piecewise_pieces(tiny_engine):
    """The same values when the forward runs through the model's pieces and the runner's static
    buffers (the path the piecewise CUDA graphs take), padded to the token buckets."""
    from batchllm.engine.model_runner import ModelRunner

    runner = tiny_engine.runner
    tiny_engine.runner = ModelRunner(runner.model, tiny_engine.arch, runner.kv_cache, runner.block_size,
                                     runner.device, tiny_engine.config.attention_backend, cuda_graphs=False,
                                     max_num_tokens=16, piecewise_on_cpu=True)
    tiny_engine.configure_scheduler(max_num_batched_tokens=16)
    asked = _run(tiny_engine, [2, None, None, 2])
    assert tiny_engine.runner.graph_counts()["piecewise_steps"] > 3
    _assert_matches(tiny_engine, asked[0], 2)
    _assert_matches(tiny_engine, asked[3], 2)


def test_prompt_logprobs_is_checked():
    with pytest.raises(ValueError, match=r"prompt_logprobs must be an integer in \[0, 20\]"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs must be an integer"):
        SamplingParams(prompt_logprobs=True)
