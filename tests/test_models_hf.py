"""HF-directory loader: tiny random Llama (llama3 rope scaling), Qwen2 (qkv bias), Mistral
checkpoints written by transformers load into our model and give the same logits."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from batchllm.models.loader import load_model
from model_helpers import run_flat

COMMON = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    bos_token_id=1, eos_token_id=2,
)
LLAMA3_SCALING = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

CASES = {
    "llama3-rope-untied": lambda: LlamaConfig(
        **COMMON, rope_theta=10000.0, rope_scaling=dict(LLAMA3_SCALING), tie_word_embeddings=False
    ),
    "llama-linear-rope-tied-headdim": lambda: LlamaConfig(
        **COMMON, head_dim=24, rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=True
    ),
    "qwen2-qkv-bias": lambda: Qwen2Config(**COMMON, rope_theta=1000000.0, tie_word_embeddings=False),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=None, tie_word_embeddings=False),
}


def _save_random_hf_model(config, directory, max_shard_size=None):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:  # biases too: transformers initialises them to zero
                param.copy_(0.1 * torch.randn_like(param))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_dir_logits_match(case, tmp_path):
    config = CASES[case]()
    hf_model = _save_random_hf_model(config, tmp_path, max_shard_size="100KB" if case == "qwen2-qkv-bias" else None)
    loaded = load_model(str(tmp_path))
    assert loaded.tokenizer_source == {"kind": "hf_dir", "path": str(tmp_path)}
    assert loaded.config.architecture == config.model_type
    assert loaded.config.qkv_bias == (case == "qwen2-qkv-bias")
    if case == "qwen2-qkv-bias":
        assert (tmp_path / "model.safetensors.index.json").exists()  # sharded checkpoint path
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, 300, (n,), generator=generator).tolist() for n in (150, 7, 33)]
    for tokens, ours in zip(sequences, run_flat(loaded, sequences)):
        with torch.no_grad():
            reference = hf_model(torch.tensor([tokens])).logits[0].float()
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)


def test_hf_config_translation(tmp_path):
    LlamaConfig(**COMMON, rope_theta=500000.0, rope_scaling=dict(LLAMA3_SCALING)).save_pretrained(tmp_path)
    from batchllm.models.hf_loader import hf_arch_config

    config = hf_arch_config(tmp_path)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling["rope_type"] == "llama3" and "rope_theta" not in config.rope_scaling
    # transformers v4-style config.json
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("rope_parameters")
    raw.update(rope_theta=1234.0, rope_scaling={"type": "linear", "factor": 4.0}, eos_token_id=[2, 5])
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = hf_arch_config(tmp_path)
    assert config.rope_theta == 1234.0 and config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert config.eos_token_ids == (2, 5)


def test_bad_specs(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="is a directory without config.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="not supported"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").unlink()
    (tmp_path / "x.gguf").write_bytes(b"NOTGGUF" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF"):
        load_model(str(tmp_path / "x.gguf"))
