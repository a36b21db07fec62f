"""random: presets: real architectures' shapes (counted, not instantiated) and a tiny model run."""

import pytest
import torch

from batchllm.models.loader import load_model
from batchllm.models.presets import PRESETS, parse_random_spec
from model_helpers import DenseCausalAttention, run_flat

# Published parameter counts (safetensors totals) of the checkpoints.
TOTAL_PARAMS = {
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-14b": 14_770_033_664,
}


@pytest.mark.parametrize("name", sorted(TOTAL_PARAMS))
def test_preset_param_counts(name):
    config = PRESETS[name]
    assert config.num_params(include_embeddings=True) == TOTAL_PARAMS[name]
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    assert config.num_params() == TOTAL_PARAMS[name] - embeddings


def test_preset_shapes():
    llama = PRESETS["llama-3.1-8b"]
    assert (llama.num_layers, llama.num_heads, llama.num_kv_heads, llama.head_dim) == (32, 32, 8, 128)
    assert llama.rope_scaling["rope_type"] == "llama3" and not llama.qkv_bias
    qwen = PRESETS["qwen2.5-7b"]
    assert qwen.qkv_bias and qwen.vocab_size == 152064 and qwen.architecture == "qwen2"


def test_overrides():
    spec = parse_random_spec("random:llama-3.1-8b?num_layers=2&vocab_size=1000&tie_word_embeddings=true&seed=7")
    assert (spec.config.num_layers, spec.config.vocab_size, spec.config.tie_word_embeddings) == (2, 1000, True)
    assert spec.seed == 7 and spec.config.hidden_size == 4096
    with pytest.raises(ValueError, match="unknown random preset"):
        parse_random_spec("random:gpt-5")
    with pytest.raises(ValueError, match="unknown override"):
        parse_random_spec("random:tiny?layers=2")


def test_tiny_runs_and_is_seeded():
    loaded = load_model("random:tiny")
    assert loaded.tokenizer_source == {"kind": "none"} and loaded.name == "random:tiny"
    params = sum(p.numel() for p in loaded.model.parameters())
    assert params == loaded.config.num_params(include_embeddings=True)
    sequences = [[1, 5, 9, 200], [3, 3, 3]]
    logits = run_flat(loaded, sequences)
    assert all(torch.isfinite(x).all() for x in logits)
    again = run_flat(load_model("random:tiny"), sequences)
    assert all(torch.equal(a, b) for a, b in zip(logits, again))
    other = run_flat(load_model("random:tiny?seed=1"), sequences)
    assert not torch.equal(logits[0], other[0])


def test_flat_batch_equals_separate_runs():
    loaded = load_model("random:tiny?num_layers=3&qkv_bias=true")
    sequences = [[1, 2, 3, 4, 5], [7, 8], [100, 101, 102]]
    together = run_flat(loaded, sequences)
    for seq, logits in zip(sequences, together):
        (alone,) = run_flat(loaded, [seq])
        torch.testing.assert_close(logits, alone, atol=1e-5, rtol=1e-5)


def test_bfloat16_one_layer_8b_shape_is_finite():
    loaded = load_model("random:llama-3.1-8b?num_layers=1&vocab_size=512&intermediate_size=256", dtype=torch.bfloat16)
    model = loaded.model
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    hidden = model(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]), DenseCausalAttention())
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (3, 512) and torch.isfinite(logits).all()


def test_fused_forward_hands_attention_a_dense_query(device):
    # XQA reads its query densely: the fused RoPE writes every layer's query into one dense buffer,
    # rather than leaving a strided view of the QKV rows that the attention would have to copy.
    model = load_model("random:tiny?num_layers=2", device=device).model
    input_ids = torch.tensor([1, 5, 9, 200, 3], device=device)
    positions = torch.arange(5, device=device)
    seen = []

    class Recording(DenseCausalAttention):
        def __call__(self, layer_index, query, key, value):
            seen.append((query.is_contiguous(), query.data_ptr()))
            return super().__call__(layer_index, query, key, value)

    with torch.no_grad():
        plain = model(input_ids, positions, DenseCausalAttention())
        model.fused_kernels = True
        fused = model(input_ids, positions, Recording())
    assert [dense for dense, _ in seen] == [True, True]
    assert seen[0][1] == seen[1][1]  # one buffer for every layer
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)
