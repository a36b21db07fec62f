"""FP8 linear layers on CPU: the quantization rule, the layer's math, quantizing presets and bf16
checkpoints at load time, FP8 checkpoints in the public layouts, and the errors where FP8 cannot
run. (The Triton kernels that fuse the quantization are checked against this math on the GPU.)"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from batchllm.config import EngineConfig, engine_config
from batchllm.models.loader import load_model
from batchllm.models.fp8_checkpoint import fp8_checkpoint_format
from batchllm.models.fp8_linear import FP8_LINEAR_NAMES, Fp8Linear
from batchllm.models.hf_loader import hf_arch_config, iter_safetensors, safetensors_files
from batchllm.models.llama import LlamaForCausalLM
from batchllm.models.presets import parse_random_spec, random_model
from batchllm.ops.fp8 import FP8_DTYPE, QuantizedActivation, fp8_linear, quantize_rows_reference, quantize_weight_rows
from capabilities import needs_cpu_fp8_gemm
from model_helpers import run_flat


def test_quantize_rows_exact_values():
    x = torch.tensor([[448.0, -1.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0], [2.0, -3.0, 1.0, 0.1]])
    q = quantize_rows_reference(x)
    # amax 448: scale 1, the values are e4m3 already
    assert q.values[0].float().tolist() == [448.0, -1.0, 0.5, 0.0]
    assert q.scales[0].item() == 1.0
    # an all-zero row stays zero (no division by zero)
    assert q.values[1].float().abs().sum().item() == 0.0 and q.scales[1].item() > 0
    # amax 3 -> inv 448/3: -3 -> -448, 2 -> 298.67 -> 288 (e4m3 step 32 there), 0.1 -> 14.93 -> 15
    assert q.values[2].float().tolist() == [288.0, -448.0, 144.0, 15.0]
    assert q.scales[2].item() == pytest.approx(3.0 / 448.0, rel=1e-7)
    assert q.values.view(torch.uint8)[2].tolist() == [0x79, 0xFE, 0x71, 0x57]  # the e4m3fn bytes


def test_static_scale_saturates_instead_of_overflowing():
    q = quantize_rows_reference(torch.tensor([[1000.0, -2000.0, 1.0]]), torch.tensor(2.0))
    assert q.values.float().tolist() == [[448.0, -448.0, 0.5]]
    assert q.scales.tolist() == [[2.0]]
    assert not torch.isnan(q.values.float()).any()


@needs_cpu_fp8_gemm
def test_fp8_linear_equals_dequantized_matmul():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 32, generator=generator)
    weight = torch.randn(48, 32, generator=generator) * 0.05
    bias = torch.randn(48, generator=generator)
    qx = quantize_rows_reference(x)
    qw, w_scale = quantize_weight_rows(weight)
    out = fp8_linear(qx, qw, w_scale, bias, torch.float32)
    expected = (qx.values.float() * qx.scales) @ (qw.float() * w_scale[:, None]).T + bias
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # and close to the unquantized product (e4m3 keeps 3 mantissa bits)
    reference = x @ weight.T + bias
    assert (out - reference).abs().max() < 0.05 * reference.abs().max()
    empty = fp8_linear(QuantizedActivation(qx.values[:0], qx.scales[:0]), qw, w_scale, None, torch.float32)
    assert empty.shape == (0, 48)


@needs_cpu_fp8_gemm
def test_random_fp8_preset_quantizes_the_bf16_draws():
    spec = parse_random_spec("random:tiny?seed=3")
    full = random_model(spec, torch.float32, torch.device("cpu"))
    fp8 = random_model(spec, torch.float32, torch.device("cpu"), fp8=True)
    for layer_full, layer_fp8 in zip(full.layers, fp8.layers):
        for name in FP8_LINEAR_NAMES:
            module = layer_fp8.get_submodule(name)
            assert isinstance(module, Fp8Linear) and module.weight.dtype == FP8_DTYPE
            values, scales = quantize_weight_rows(layer_full.get_submodule(name).weight)
            assert torch.equal(module.weight.view(torch.uint8), values.view(torch.uint8))
            assert torch.equal(module.weight_scale, scales)
    # embedding, norms and LM head stay in the model dtype, equal to the full model's
    assert torch.equal(fp8.embed_tokens.weight, full.embed_tokens.weight)
    assert fp8.layers[0].input_layernorm.weight.dtype == torch.float32
    # the FP8 model's logits stay close to the full model's
    tokens = [[5, 17, 300, 41, 9, 77, 2, 64]]
    ours, reference = run_flat(fp8, tokens)[0], run_flat(full, tokens)[0]
    assert (ours - reference).abs().max() < 0.1 * reference.abs().max()


def _write_hf_checkpoint(directory, seed=0):
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in name else 0.1 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    return model


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _to_fp8_layout(directory, per_channel: bool, static: bool) -> dict:
    """Rewrite the checkpoint as the FP8 releases store it; returns the quantized tensors."""
    tensors = load_file(str(directory / "model.safetensors"))
    out = {}
    for name, tensor in tensors.items():
        if name.rsplit(".", 2)[-2] in PROJECTIONS and name.endswith(".weight"):
            if per_channel:
                values, scales = quantize_weight_rows(tensor)
                scale_tensor = scales[:, None]  # [out, 1] as the releases store it
            else:
                amax = tensor.abs().max()
                scale_tensor = (amax / 448.0).reshape(())
                values = (tensor / scale_tensor).clamp(-448, 448).to(FP8_DTYPE)
            out[name] = values
            out[name + "_scale"] = scale_tensor.float()
            if static:  # a different calibration scale per projection
                out[name.replace(".weight", ".input_scale")] = torch.tensor(0.01 * (1 + len(out) % 5))
        else:
            out[name] = tensor
        # the KV-cache scales some releases carry are skipped
    out["model.layers.0.self_attn.k_scale"] = torch.tensor(1.0)
    save_file(out, str(directory / "model.safetensors"))
    raw = json.loads((directory / "config.json").read_text())
    if per_channel:
        raw["quantization_config"] = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                                      "modules_to_not_convert": ["lm_head"]}
    else:
        activations = {"dynamic": False, "num_bits": 8, "strategy": "tensor", "type": "float"} if static else None
        raw["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": activations,
                                          "weights": {"num_bits": 8, "strategy": "tensor", "type": "float"}}},
        }
    (directory / "config.json").write_text(json.dumps(raw))
    return out


@needs_cpu_fp8_gemm
@pytest.mark.parametrize("per_channel,static", [(False, True), (False, False), (True, False)])
def test_fp8_checkpoint_layouts_load(tmp_path, per_channel, static):
    hf_model = _write_hf_checkpoint(tmp_path)
    tensors = _to_fp8_layout(tmp_path, per_channel, static)
    checkpoint = fp8_checkpoint_format(tmp_path)
    assert checkpoint.static_input_scales == static
    config = hf_arch_config(tmp_path)
    model = LlamaForCausalLM.empty(config, torch.float32, torch.device("cpu"), fp8=True,
                                   static_input_scales=checkpoint.static_input_scales)
    model.load_hf_weights(iter_safetensors(safetensors_files(tmp_path)))
    qkv = model.layers[1].self_attn.qkv_proj
    prefix = "model.layers.1.self_attn."
    # the e4m3 bytes are copied as they are, the scales expanded over each part's rows
    parts = [tensors[prefix + p + ".weight"] for p in ("q_proj", "k_proj", "v_proj")]
    assert torch.equal(qkv.weight.view(torch.uint8), torch.cat(parts).view(torch.uint8))
    scales = [tensors[prefix + p + ".weight_scale"].reshape(-1).expand(t.shape[0])
              for p, t in zip(("q_proj", "k_proj", "v_proj"), parts)]
    assert torch.equal(qkv.weight_scale, torch.cat(scales))
    if static:
        expected = max(tensors[prefix + p + ".input_scale"].item() for p in ("q_proj", "k_proj", "v_proj"))
        assert qkv.input_scale.item() == pytest.approx(expected)
    else:
        assert qkv.input_scale is None
    assert model.lm_head.weight.dtype == torch.float32
    # logits stay near the unquantized model's (static scales here are not calibrated: skip them)
    if not static:
        tokens = [[3, 99, 250, 7, 12, 1, 45]]
        ours = run_flat(model, tokens)[0]
        with torch.no_grad():
            reference = hf_model(torch.tensor(tokens)).logits[0]
        error = (ours - reference).abs().mean() / reference.abs().mean()
        assert error < 0.15, error  # a tiny random model: loaded garbage would be ~1


def test_fp8_checkpoint_on_cpu_is_a_clear_error(tmp_path):
    _write_hf_checkpoint(tmp_path)
    _to_fp8_layout(tmp_path, per_channel=True, static=False)
    with pytest.raises(ValueError, match=r"FP8 checkpoint .* compute capability 8\.9 .* bf16 release"):
        load_model(str(tmp_path))


def test_unsupported_quantizations_are_named(tmp_path):
    _write_hf_checkpoint(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    for section, message in (({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise"),
                             ({"quant_method": "awq", "bits": 4}, "'awq' is not supported")):
        (tmp_path / "config.json").write_text(json.dumps({**raw, "quantization_config": section}))
        with pytest.raises(ValueError, match=message):
            fp8_checkpoint_format(tmp_path)


def test_fp8_flags_on_cpu_name_what_works_instead():
    from batchllm.engine.loading import load_parts

    with pytest.raises(ValueError, match=r"--quantization fp8 needs .* 8\.9 .* Run without it"):
        load_model("random:tiny", quantization="fp8")
    config = engine_config("random:tiny", device="cpu", dtype="bfloat16", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=r"--kv-cache-dtype fp8 needs .* --kv-cache-dtype auto"):
        load_parts(config)
    with pytest.raises(ValueError, match="quantization must be one of fp8"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="computes in bfloat16"):
        load_parts(EngineConfig(model="random:tiny", device="cpu", quantization="fp8"))
