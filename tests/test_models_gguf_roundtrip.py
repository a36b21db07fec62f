"""GGUF files written like llama.cpp's converter (q/k permuted for llama, not for qwen2; llama3
rope as a rope_freqs tensor) load back to the transformers model's logits; the fast reader
agrees with gguf.GGUFReader."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from batchllm.models.loader import load_model
from batchllm.models.config import ModelArchConfig
from batchllm.models.gguf_file import read_gguf
from batchllm.models.rope import rope_inverse_frequencies
from model_helpers import default_gguf_path, run_flat

gguf = pytest.importorskip("gguf")

COMMON = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
RENAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute
    return weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{RENAMES[module]}.{kind}"


def write_gguf(hf_model, arch: str, path, rope_freqs: np.ndarray | None):
    config = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in hf_model.state_dict().items():
        weights = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            weights = llama_cpp_permute(weights, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            weights = llama_cpp_permute(weights, config.num_key_value_heads)
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(weights))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def random_hf_model(config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn_like(param))
    return model


def llama3_freq_factors(config) -> np.ndarray:
    # llama.cpp stores the llama3 scaling as divisors of the plain inverse frequencies
    arch = ModelArchConfig(
        architecture="llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=None, max_position_embeddings=256, tie_word_embeddings=False, qkv_bias=False,
        bos_token_id=1, eos_token_ids=(2,),
    )
    plain = rope_inverse_frequencies(arch)
    scaled = rope_inverse_frequencies(ModelArchConfig(**{**arch.__dict__, "rope_scaling": dict(LLAMA3)}))
    return (plain / scaled).numpy()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_roundtrip_matches_hf(arch, tmp_path):
    if arch == "llama":
        hf_model = random_hf_model(LlamaConfig(**COMMON, rope_theta=10000.0, rope_scaling=dict(LLAMA3)))
        rope_freqs = llama3_freq_factors(hf_model.config)
    else:
        hf_model = random_hf_model(Qwen2Config(**COMMON, rope_theta=10000.0))
        rope_freqs = None
    path = tmp_path / "model.gguf"
    write_gguf(hf_model, arch, path, rope_freqs)
    loaded = load_model(str(path))
    assert loaded.config.architecture == arch and loaded.config.qkv_bias == (arch == "qwen2")
    assert (loaded.config.rope_scaling is not None) == (arch == "llama")
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, 300, (n,), generator=generator).tolist() for n in (120, 9)]
    for tokens, ours in zip(sequences, run_flat(loaded, sequences)):
        with torch.no_grad():
            reference = hf_model(torch.tensor([tokens])).logits[0]
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)


def test_fast_reader_agrees_with_gguf_reader():
    path = default_gguf_path()
    ours = read_gguf(path)
    reference = gguf.GGUFReader(str(path))
    for key in ("llama.block_count", "llama.rope.freq_base", "tokenizer.ggml.model", "tokenizer.chat_template"):
        assert ours.metadata[key] == reference.fields[key].contents()
    assert ours.metadata["tokenizer.ggml.tokens"][:50] == reference.fields["tokenizer.ggml.tokens"].contents()[:50]
    assert len(ours.tensors) == len(reference.tensors)
    for mine, theirs in list(zip(ours.tensors, reference.tensors))[:12]:
        assert mine.name == theirs.name and mine.ggml_type == int(theirs.tensor_type)
        assert np.array_equal(np.asarray(mine.data), np.asarray(theirs.data))
