"""Greedy outputs with presence, frequency and repetition penalties and min_tokens equal HF
transformers `generate` with the matching logits processors, token for token (the default model
in float32). Every setting runs in ONE engine batch, next to requests without penalties."""

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from batchllm import SamplingParams

from model_fixtures import hf_prompt_token_ids

pytest_plugins = ["model_fixtures"]

DOCUMENT = ("The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 individual "
            "reefs and 900 islands. The reef is located in the Coral Sea, off the coast of Queensland.")
COMPLETIONS = ["The capital of France is", "List the days of the week: Monday, Tuesday,",
               DOCUMENT + "\n\nQuestion: Where is the reef located?\nAnswer:"]
CHATS = [[{"role": "user", "content": "What is 2 + 2?"}],
         [{"role": "user", "content": "Say yes."}]]
MAX_TOKENS = 14
# (presence, frequency, repetition, min_tokens)
SETTINGS = {
    "none": (0.0, 0.0, 1.0, 0),
    "presence": (1.5, 0.0, 1.0, 0),
    "frequency": (0.0, 1.2, 1.0, 0),
    "negative": (-0.8, -0.5, 1.0, 0),
    "repetition": (0.0, 0.0, 1.4, 0),
    "all": (0.6, 0.4, 1.2, 10),
    "min_tokens": (0.0, 0.0, 1.0, 13),
}


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the generated tokens (those past the prompt)."""

    def __init__(self, presence: float, frequency: float, prompt_len: int) -> None:
        self.presence, self.frequency, self.prompt_len = presence, frequency, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


@pytest.fixture(scope="module")
def prompt_token_ids(session_default_llm):
    return hf_prompt_token_ids(session_default_llm, COMPLETIONS, CHATS)


def _hf_generate(hf_model, ids, eos_token_ids, presence, frequency, repetition, min_tokens):
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        generated = hf_model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=MAX_TOKENS, do_sample=False,
            eos_token_id=eos_token_ids, pad_token_id=eos_token_ids[0], repetition_penalty=repetition,
            min_new_tokens=min_tokens, logits_processor=LogitsProcessorList([OpenAIPenalties(presence, frequency,
                                                                                             len(ids))]),
        )
    return generated[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def engine_and_hf_outputs(session_default_llm, hf_default_model, prompt_token_ids):
    llm = session_default_llm
    eos = sorted(llm.engine.eos_token_ids)
    prompts, params, expected, labels = [], [], [], []
    for name, (presence, frequency, repetition, min_tokens) in SETTINGS.items():
        for index, ids in enumerate(prompt_token_ids):
            prompts.append(ids)
            params.append(SamplingParams(temperature=0, max_tokens=MAX_TOKENS, presence_penalty=presence,
                                         frequency_penalty=frequency, repetition_penalty=repetition,
                                         min_tokens=min_tokens))
            expected.append(_hf_generate(hf_default_model, ids, eos, presence, frequency, repetition, min_tokens))
            labels.append(f"{name}, prompt {index}")
    return llm, prompts, params, expected, labels


@pytest.mark.parametrize("policy", ["batchllm", "vllm"])
def test_penalised_greedy_tokens_equal_hf_generate(default_llm, engine_and_hf_outputs, policy):
    llm, prompts, params, expected, labels = engine_and_hf_outputs
    default_llm.engine.configure_scheduler(policy=policy, max_num_batched_tokens=96)
    results = llm.generate(prompts, params, use_tqdm=False)
    for result, theirs, label in zip(results, expected, labels):
        assert result.outputs[0].token_ids == theirs, label


def test_the_settings_change_the_tokens(engine_and_hf_outputs):
    """Each penalty changes some answer (so the equality above is not that of plain greedy), and
    min_tokens keeps a chat going past its natural end."""
    _, prompts, params, expected, labels = engine_and_hf_outputs
    num_prompts = len(prompts) // len(SETTINGS)
    by_setting = {name: expected[i * num_prompts:(i + 1) * num_prompts] for i, name in enumerate(SETTINGS)}
    for name in SETTINGS:
        if name != "none":
            assert by_setting[name] != by_setting["none"], name
    natural = [len(tokens) for tokens in by_setting["none"]]
    assert min(natural) < SETTINGS["min_tokens"][3]  # some answer ends before min_tokens on its own
    assert all(len(tokens) >= SETTINGS["min_tokens"][3] for tokens in by_setting["min_tokens"])
