"""Our decoder on the default GGUF matches transformers loading the same file."""

import time

import pytest
import torch

from model_helpers import default_gguf_path, run_flat

pytest_plugins = ["model_fixtures"]

PROMPTS = [
    [1, 504, 3458, 282, 4649, 314, 216],  # arbitrary ids, bos first
    [9690, 198, 2683, 359, 253, 5356, 11173, 3365, 28, 1069, 2314, 17, 2, 198, 1, 4093, 198],
    [42, 17, 999, 12345, 49151, 0, 7],
]


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def test_gguf_config(default_model):
    config = default_model.config
    assert (config.architecture, config.num_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.tie_word_embeddings and config.eos_token_ids == (2,)
    assert default_model.tokenizer_source["kind"] == "gguf"
    assert default_model.model.embed_tokens.weight.dtype == torch.float32


def test_gguf_logits_match_hf(default_model, hf_default_model):
    # all prompts in one flat batch: also checks sequences do not leak into each other
    ours = run_flat(default_model, PROMPTS)
    for prompt, logits in zip(PROMPTS, ours):
        reference = hf_logits(hf_default_model, prompt)
        torch.testing.assert_close(logits, reference, atol=1e-3, rtol=1e-4)
        assert torch.equal(logits.argmax(-1), reference.argmax(-1))


def test_gguf_positions_offset(default_model, hf_default_model):
    # a sequence split into prefix + suffix steps cannot be run without a KV cache here, but
    # positions that do not start at 0 must still rotate consistently: same logits when the
    # whole sequence is the step.
    prompt = PROMPTS[1]
    (ours,) = run_flat(default_model, [prompt])
    assert torch.equal(ours.argmax(-1), hf_logits(hf_default_model, prompt).argmax(-1))


def test_gguf_load_time(default_model):
    from batchllm.models import load_model

    start = time.perf_counter()
    load_model(str(default_gguf_path()))
    seconds = time.perf_counter() - start
    print(f"GGUF load: {seconds:.2f} s")
    assert seconds < 20
