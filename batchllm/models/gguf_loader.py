"""Load a llama.cpp GGUF file: config from its metadata, weights dequantized at load.

llama.cpp's converter permutes the rows of attn_q / attn_k of "llama"-architecture models
(interleaved rotary pairs); we undo it exactly as transformers' LlamaTensorProcessor does.
"""

from __future__ import annotations

import re
import warnings
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from batchllm.models.config import SUPPORTED_ARCHITECTURES, ModelArchConfig
from batchllm.models.gguf_file import GGUFFile, GGUFTensorInfo
from batchllm.models.refusals import SUPPORTED_ARCHITECTURES_TEXT, UnsupportedModelError, unsupported_architecture

# Architectures whose q/k rows llama.cpp permuted at conversion (it writes Mistral models as "llama").
_PERMUTED_QK = {"llama", "mistral"}

_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_LAYER_RENAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_RENAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_arch_config(gguf: GGUFFile) -> ModelArchConfig:
    metadata = gguf.metadata
    gguf_arch = metadata.get("general.architecture")
    if gguf_arch not in SUPPORTED_ARCHITECTURES:
        raise unsupported_architecture("GGUF general.architecture", gguf_arch)
    tensor_names = {tensor.name for tensor in gguf.tensors}

    def key(name: str, default: object = None) -> object:
        value = metadata.get(f"{gguf_arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {gguf_arch}.{name}")
        return value

    hidden_size = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    vocab_size = metadata.get(f"{gguf_arch}.vocab_size")
    if vocab_size is None:
        vocab_size = len(metadata["tokenizer.ggml.tokens"])
    eos_names = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    head_dim = int(metadata.get(f"{gguf_arch}.attention.key_length") or hidden_size // num_heads)
    window = metadata.get(f"{gguf_arch}.attention.sliding_window")  # llama.cpp's key, when the converter wrote it
    return ModelArchConfig(
        architecture=gguf_arch,
        vocab_size=int(vocab_size),
        hidden_size=hidden_size,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(gguf, gguf_arch),
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(metadata[name] for name in eos_names if metadata.get(name) is not None),
        sliding_window=None if window is None else int(window),
    )


def _rope_scaling(gguf: GGUFFile, gguf_arch: str) -> dict | None:
    metadata = gguf.metadata
    # Llama-3.x GGUFs carry the llama3 scaling as a precomputed per-pair divisor tensor.
    for tensor in gguf.tensors:
        if tensor.name == "rope_freqs.weight":
            factors = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
            return {"rope_type": "freq_factors", "freq_factors": tuple(float(f) for f in factors)}
    scaling_type = metadata.get(f"{gguf_arch}.rope.scaling.type")
    if scaling_type in (None, "none"):
        return None
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": float(metadata[f"{gguf_arch}.rope.scaling.factor"])}
    raise UnsupportedModelError(f"GGUF RoPE scaling {scaling_type!r} is not supported "
                                "(fix: a model with plain RoPE, linear or llama3 scaling)")


def reverse_permute_qk(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's permute (transformers LlamaTensorProcessor._reverse_permute_weights)."""
    dim = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_RENAMES:
        return _GLOBAL_RENAMES[gguf_name]
    if gguf_name == "rope_freqs.weight":
        return None  # folded into the config's rope_scaling
    match = _LAYER_TENSOR.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_RENAMES:
        raise UnsupportedModelError(
            f"GGUF tensor {gguf_name!r} is not part of the Llama-family layout this engine runs (fix: a model of a "
            f"supported architecture: {SUPPORTED_ARCHITECTURES_TEXT})")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{_LAYER_RENAMES[kind]}.{suffix}"


def _dequantized(tensor: GGUFTensorInfo, config: ModelArchConfig, permute_qk: bool) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if tensor.ggml_type == GGMLQuantizationType.F32:
        weights = tensor.data  # read-only memmap view; copied into the parameter
    else:
        quant_type = GGMLQuantizationType(tensor.ggml_type)
        try:
            weights = dequantize(tensor.data, quant_type)  # float32 [out, in]
        except NotImplementedError:
            raise UnsupportedModelError(
                f"GGUF tensor {tensor.name!r} is stored as {quant_type.name}, which the gguf package cannot "
                "dequantize (fix: a GGUF of another quantization type, such as F16, Q8_0 or Q4_K_M)") from None
    if permute_qk:
        if ".attn_q." in tensor.name:
            weights = reverse_permute_qk(weights, config.num_heads)
        elif ".attn_k." in tensor.name:
            weights = reverse_permute_qk(weights, config.num_kv_heads)
    return weights


def iter_gguf_weights(
    gguf: GGUFFile, config: ModelArchConfig, num_threads: int = 4
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) pairs in file order. Dequantization runs on a thread pool (numpy
    frees the GIL); at most 2 * num_threads tensors are in flight, so memory stays bounded."""
    permute_qk = config.architecture in _PERMUTED_QK
    tensors = [(tensor, _hf_name(tensor.name)) for tensor in gguf.tensors]
    pending: deque = deque()
    with ThreadPoolExecutor(max_workers=num_threads) as pool:
        for tensor, name in tensors:
            if name is not None:
                pending.append((name, pool.submit(_dequantized, tensor, config, permute_qk)))
            if len(pending) >= 2 * num_threads:
                yield _finished(*pending.popleft())
        while pending:
            yield _finished(*pending.popleft())


def _finished(name: str, future: Future) -> tuple[str, torch.Tensor]:
    with warnings.catch_warnings():
        # F32 tensors are read-only memmap views; torch only reads them (copy_ into the parameter).
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return name, torch.from_numpy(np.ascontiguousarray(future.result()))

