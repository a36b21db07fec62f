"""Our decoder on the default GGUF matches transformers loading the same file."""

import torch

from model_helpers import run_flat

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


class CachedAttention:
    """One sequence with a growing per-layer KV cache: rows of a step sit after the cached ones."""

    def __init__(self):
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def __call__(self, layer_index, query, key, value):
        # query: [T, num_heads, head_dim]; key, value: [T, num_kv_heads, head_dim]
        past = self.keys[layer_index].shape[0] if layer_index in self.keys else 0
        self.keys[layer_index] = torch.cat([self.keys.get(layer_index, key[:0]), key])
        self.values[layer_index] = torch.cat([self.values.get(layer_index, value[:0]), value])
        group = query.shape[1] // key.shape[1]
        keys = self.keys[layer_index].repeat_interleave(group, dim=1)  # [past + T, num_heads, head_dim]
        values = self.values[layer_index].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query, keys) / query.shape[-1] ** 0.5
        rows = torch.arange(query.shape[0])[:, None] + past
        scores = scores.masked_fill(torch.arange(keys.shape[0])[None, :] > rows, float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def test_gguf_chunked_prefill_and_decode(default_model, hf_default_model):
    # prefix chunk, then a chunk at positions 5.., then one-token decode steps: the engine's
    # usage pattern. Logits of each step equal the matching rows of one full-sequence run.
    prompt = PROMPTS[1]
    model = default_model.model
    attention = CachedAttention()
    steps = [(0, 5), (5, 14), (14, 15), (15, 16), (16, len(prompt))]
    with torch.no_grad():
        ours = torch.cat([
            model.compute_logits(model(torch.tensor(prompt[a:b]), torch.arange(a, b), attention))
            for a, b in steps
        ])
    torch.testing.assert_close(ours, hf_logits(hf_default_model, prompt), atol=1e-3, rtol=1e-4)


def test_gguf_load_time(default_model_load_seconds):
    seconds = default_model_load_seconds  # the session's load of the default model
    print(f"GGUF load: {seconds:.2f} s")
    assert seconds < 120  # measured 4.6 s of CPU, 16 s of wall time on a loaded 2-core machine
