"""What the model loaders accept, and the errors for what they do not: each message names the
real cause and a fix (torch-free)."""

from __future__ import annotations

from batchllm.models.config import SUPPORTED_ARCHITECTURES

ARCHITECTURE_NAMES = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}
SUPPORTED_ARCHITECTURES_TEXT = ", ".join(
    f"{ARCHITECTURE_NAMES[name]} ({name})" for name in SUPPORTED_ARCHITECTURES)
SUPPORTED_CHECKPOINTS_TEXT = (
    "a bf16, fp16 or fp32 safetensors checkpoint (in FP8 with --quantization fp8 if you like), "
    "an FP8 checkpoint (quant_method fp8, fbgemm_fp8, or compressed-tensors with 8-bit float weights) "
    "or a GGUF file")
MODEL_SPECS_TEXT = ("a .gguf file, a Hugging Face model directory, a Hugging Face model id in the local "
                    "Hugging Face cache, or random:PRESET")


class UnsupportedModelError(ValueError):
    """A model this engine does not load; the message says why and what it loads instead."""


class ModelNotFoundError(FileNotFoundError):
    """A --model value that names nothing on this machine; the message names the fix."""


def unsupported_architecture(where: str, architecture: object) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{where} {architecture!r} is not supported (fix: a model of a supported architecture: "
        f"{SUPPORTED_ARCHITECTURES_TEXT})")


def unsupported_quantization(where: str, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{where}: {what} is not supported: GPTQ, AWQ, bitsandbytes and other integer quantizations are not "
        f"loaded (fix: use {SUPPORTED_CHECKPOINTS_TEXT})")
