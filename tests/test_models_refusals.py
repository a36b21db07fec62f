"""Models the engine does not load are refused with their real cause and a fix that applies to
them, in the Python API and in `batchllm run` (exit 2, one line)."""

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from batchllm.cli.main import main
from batchllm.models.loader import load_model
from batchllm.models.refusals import ModelNotFoundError, UnsupportedModelError
from batchllm.models.tokenizer import load_tokenizer

SUPPORTED = "Llama (llama), Qwen2 (qwen2), Mistral (mistral)"
TINY_LLAMA = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)


def _hf_checkpoint(directory, **config_changes):
    """A random-weight tiny Llama checkpoint (config.json + model.safetensors), no tokenizer."""
    from transformers import AutoModelForCausalLM

    config = LlamaConfig(**TINY_LLAMA)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory, safe_serialization=True)
    if config_changes:
        raw = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**raw, **config_changes}))
    return directory


def _run_model(tmp_path, model, capsys):
    """`batchllm run` on one token-id line with --model model: (exit code, stderr)."""
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"custom_id": "a", "prompt_token_ids": [1, 2, 3], "max_tokens": 2}) + "\n")
    code = main(["run", str(path), "-o", str(tmp_path / "out.jsonl"), "--model", str(model), "--no-progress",
                 "--device", "cpu"])
    return code, capsys.readouterr().err


def test_a_gptq_directory_is_told_that_gptq_is_not_supported(tmp_path, capsys):
    model_dir = _hf_checkpoint(tmp_path / "gptq", quantization_config={"quant_method": "gptq", "bits": 4})
    code, err = _run_model(tmp_path, model_dir, capsys)
    assert code == 2
    assert err.splitlines()[-1] == (
        f"error: cannot load the model {model_dir}: {model_dir}: config.json quant_method 'gptq' is not supported: "
        "GPTQ, AWQ, bitsandbytes and other integer quantizations are not loaded (fix: use a bf16, fp16 or fp32 "
        "safetensors checkpoint (in FP8 with --quantization fp8 if you like), an FP8 checkpoint (quant_method fp8, "
        "fbgemm_fp8, or compressed-tensors with 8-bit float weights) or a GGUF file)")
    assert "HF model directory" not in err


@pytest.mark.parametrize("section, cause", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "type": "int", "num_bits": 4, "strategy": "group"}}}},
     "compressed-tensors weights (int, 4 bits, strategy group; 8-bit float weights per tensor or per channel "
     "are loaded) is not supported"),
])
def test_other_quantizations_name_their_method_and_what_loads(tmp_path, section, cause):
    model_dir = _hf_checkpoint(tmp_path, quantization_config=section)
    with pytest.raises(UnsupportedModelError) as raised:
        load_model(str(model_dir))
    assert cause in str(raised.value) and "--quantization fp8" in str(raised.value)


def test_an_unsupported_architecture_lists_the_supported_ones(tmp_path, capsys):
    model_dir = _hf_checkpoint(tmp_path / "m", model_type="gpt2")
    code, err = _run_model(tmp_path, model_dir, capsys)
    assert code == 2
    assert err.splitlines()[-1] == (
        f"error: cannot load the model {model_dir}: {model_dir}: config.json model_type 'gpt2' is not supported "
        f"(fix: a model of a supported architecture: {SUPPORTED})")


def test_a_gguf_of_an_unsupported_architecture_lists_the_supported_ones(tmp_path):
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError) as raised:
        load_model(str(path))
    assert str(raised.value) == ("GGUF general.architecture 'phi3' is not supported (fix: a model of a supported "
                                 f"architecture: {SUPPORTED})")


def test_unsupported_rope_scaling_and_mlp_bias_are_named(tmp_path):
    model_dir = _hf_checkpoint(tmp_path, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    with pytest.raises(UnsupportedModelError, match="RoPE scaling 'yarn' is not supported"):
        load_model(str(model_dir))
    _hf_checkpoint(tmp_path, mlp_bias=True)
    with pytest.raises(UnsupportedModelError, match="mlp_bias=True"):
        load_model(str(model_dir))


def test_a_tensor_without_a_place_is_a_layout_refusal(tmp_path):
    model_dir = _hf_checkpoint(tmp_path)
    weights = load_file(model_dir / "model.safetensors")
    save_file({**weights, "model.vision_tower.weight": torch.zeros(2)}, model_dir / "model.safetensors")
    with pytest.raises(UnsupportedModelError) as raised:
        load_model(str(model_dir))
    assert str(raised.value) == (f"{model_dir}: unexpected checkpoint tensor 'model.vision_tower.weight': not the "
                                 f"layout of a supported architecture (fix: a model of a supported architecture: "
                                 f"{SUPPORTED})")


def test_checkpoints_without_safetensors_or_tokenizer_name_the_conversion(tmp_path):
    model_dir = _hf_checkpoint(tmp_path)
    with pytest.raises(UnsupportedModelError, match=r"cannot load the tokenizer of .*tokenizer\.json"):
        load_tokenizer({"kind": "hf_dir", "path": str(model_dir)})
    (model_dir / "model.safetensors").rename(model_dir / "pytorch_model.bin")
    with pytest.raises(UnsupportedModelError, match=r"no \*\.safetensors files: only safetensors checkpoints are "
                                                    r"loaded \(fix: convert it with transformers"):
        load_model(str(model_dir))


def test_paths_that_are_no_model_say_what_to_pass(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"not found \(fix: check the path; --model takes a \.gguf file"):
        load_model(str(tmp_path / "missing"))
    (tmp_path / "b.gguf").write_bytes(b"")
    (tmp_path / "a.gguf").write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match=rf"GGUF files \(fix: pass one of them: --model {tmp_path}/a\.gguf "
                                                    r"\(or b\.gguf\)\)"):
        load_model(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match=rf"is a weights file \(fix: .* --model {tmp_path}\)"):
        load_model(str(tmp_path / "model.safetensors"))
