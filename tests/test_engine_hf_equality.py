"""End to end: greedy outputs of the engine equal HF transformers `generate`, token for token.

Both run the default model (SmolLM2-135M-Instruct, the same dequantized GGUF weights) in
float32. The engine runs all prompts as ONE batch (continuous batching, chunked prefill, shared
prefixes); HF runs each prompt alone without padding.
"""

import pytest
import torch

from batchllm import SamplingParams

from model_fixtures import hf_prompt_token_ids

pytest_plugins = ["model_fixtures"]

DOCUMENT = (
    "The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 individual "
    "reefs and 900 islands stretching for over 2,300 kilometres over an area of approximately 344,400 square "
    "kilometres. The reef is located in the Coral Sea, off the coast of Queensland, Australia. It can be seen "
    "from outer space and is the world's biggest single structure made by living organisms."
)
# Two prefix groups (three completions on DOCUMENT, two chats with it as the system message)
# and three prompts that share nothing beyond the chat template.
COMPLETIONS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    DOCUMENT + "\n\nQuestion: Where is the reef located?\nAnswer:",
    DOCUMENT + "\n\nQuestion: How many islands does it have?\nAnswer:",
    DOCUMENT + "\n\nQuestion: Can it be seen from space?\nAnswer:",
]
CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Use the document.\n" + DOCUMENT}, {"role": "user", "content": "Summarise it."}],
    [{"role": "system", "content": "Use the document.\n" + DOCUMENT}, {"role": "user", "content": "How long is it?"}],
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def prompt_token_ids(session_default_llm):
    return hf_prompt_token_ids(session_default_llm, COMPLETIONS, CHATS)


@pytest.fixture(scope="module")
def hf_outputs(hf_default_model, prompt_token_ids):
    outputs = []
    eos = hf_default_model.generation_config.eos_token_id
    for ids in prompt_token_ids:
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            generated = hf_default_model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=MAX_TOKENS,
                do_sample=False, pad_token_id=eos if isinstance(eos, int) else eos[0],
            )
        outputs.append(generated[0, len(ids):].tolist())
    return outputs


@pytest.fixture
def llm(default_llm):
    # A small token budget forces chunked prefill across steps; a tight KV cache is not the point here.
    default_llm.engine.configure_scheduler(max_num_batched_tokens=96)
    return default_llm


def _engine_outputs(llm, prompt_token_ids, policy):
    llm.engine.configure_scheduler(policy=policy)
    results = llm.generate(prompt_token_ids, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [r.outputs[0].token_ids for r in results]


def test_prompts_really_share_prefixes(prompt_token_ids):
    assert len(prompt_token_ids) == 8
    assert prompt_token_ids[2][:60] == prompt_token_ids[3][:60] == prompt_token_ids[4][:60]
    assert prompt_token_ids[6][:60] == prompt_token_ids[7][:60]
    assert prompt_token_ids[2][:60] != prompt_token_ids[6][:60]
    lengths = sorted(len(ids) for ids in prompt_token_ids)
    assert lengths[0] < 10 and lengths[-1] > 100


def _assert_same_or_exact_tie(hf_model, prompt, mine, theirs, label):
    """Token-identical, except that at an exact float32 tie in HF's own logits (top two within
    1e-4) either choice is greedy; after such a tie the continuations may legitimately differ."""
    if mine == theirs:
        return
    diverge = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
    assert diverge < min(len(mine), len(theirs)), f"{label}: one output is a prefix of the other"
    with torch.no_grad():
        logits = hf_default_logits(hf_model, prompt + theirs[:diverge])
    margin = float(logits[theirs[diverge]] - logits[mine[diverge]])
    assert margin < 1e-4, f"{label}: token {diverge} differs ({mine[diverge]} vs HF {theirs[diverge]}, margin {margin})"


def hf_default_logits(hf_model, token_ids):
    return hf_model(torch.tensor([token_ids])).logits[0, -1].float()


@pytest.mark.parametrize("policy", ["batchllm", "simple", "vllm", "sglang"])
def test_greedy_tokens_equal_hf_generate(llm, hf_default_model, prompt_token_ids, hf_outputs, policy):
    ours = _engine_outputs(llm, prompt_token_ids, policy)
    for index, (mine, theirs) in enumerate(zip(ours, hf_outputs)):
        _assert_same_or_exact_tie(hf_default_model, prompt_token_ids[index], mine, theirs,
                                  f"prompt {index} under policy {policy}")
    if policy == "batchllm":
        assert llm.last_run_stats.num_prompt_tokens == sum(len(ids) for ids in prompt_token_ids)


def test_piecewise_steps_give_hf_tokens(llm, hf_default_model, prompt_token_ids, hf_outputs):
    """The same outputs when every step runs through the model's pieces and the runner's static
    buffers, padded to the token buckets (uncaptured on the CPU: the path the piecewise CUDA graphs
    take on a GPU)."""
    from batchllm.engine.model_runner import ModelRunner

    engine = llm.engine  # (the fixture puts the engine's own runner back afterwards)
    runner = engine.runner
    engine.runner = ModelRunner(runner.model, engine.arch, runner.kv_cache, runner.block_size, runner.device,
                                engine.config.attention_backend, cuda_graphs=False, max_num_tokens=96,
                                piecewise_on_cpu=True)
    ours = _engine_outputs(llm, prompt_token_ids, "batchllm")
    assert engine.runner.graph_counts()["piecewise_steps"] == llm.last_run_stats.num_steps > 10
    for index, (mine, theirs) in enumerate(zip(ours, hf_outputs)):
        _assert_same_or_exact_tie(hf_default_model, prompt_token_ids[index], mine, theirs,
                                  f"prompt {index} through the pieces")


def test_prompt_logprobs_equal_hf_log_softmax(llm, hf_default_model, prompt_token_ids):
    """prompt_logprobs over prompts prefilled in 96-token chunks, two of them sharing a prefix with
    a request that does not ask: each position's logprobs are HF's log_softmax of its logits."""
    params = [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=k) for k in (2, None, 5)]
    prompts = prompt_token_ids[2:5]
    results = llm.generate(prompts, params, use_tqdm=False)
    assert results[1].prompt_logprobs is None
    for prompt, result, num_top in ((prompts[0], results[0], 2), (prompts[2], results[2], 5)):
        with torch.no_grad():
            reference = torch.log_softmax(hf_default_model(torch.tensor([prompt])).logits[0].double(), dim=-1)
        entries = result.prompt_logprobs
        assert len(entries) == len(prompt) > 96 and entries[0] is None
        for position in range(1, len(prompt)):
            row = reference[position - 1]
            assert set(entries[position]) == {prompt[position], *torch.topk(row, num_top).indices.tolist()}
            for token_id, logprob in entries[position].items():
                assert logprob == pytest.approx(float(row[token_id]), abs=2e-3)
