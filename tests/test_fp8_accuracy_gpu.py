"""The FP8 accuracy gate on the default model (GPU of compute capability 8.9+): FP8 linear layers,
then also the FP8 KV cache, against bf16 over 2048 tokens of the repository's text.

Where the GGUF tokenizer cannot load (transformers and gguf are missing), the token ids come from
the file that BATCHLLM_FP8_TOKENS_FILE names, written elsewhere by
`PYTHONPATH=. python3 benchmarks/fp8_accuracy.py --write-tokens-file PATH`."""

import importlib.util
import os

import pytest
import torch

from batchllm.perf.fp8_accuracy import FP8_VARIANTS, GATES, AccuracyOptions, measure_fp8_accuracy
from batchllm.models.fp8_linear import fp8_unsupported_reason

pytestmark = [pytest.mark.gpu, pytest.mark.default_model]

NUM_TOKENS = 2048
TOKENS_FILE_VARIABLE = "BATCHLLM_FP8_TOKENS_FILE"


@pytest.fixture(scope="module")
def fp8_device():
    reason = fp8_unsupported_reason("cuda")
    if reason:
        pytest.skip(reason)
    from batchllm.models.default_model import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    return "cuda"


def _token_ids() -> list[int]:
    from batchllm.perf.eval_text import cut_tokens, read_tokens_file, text_token_ids

    try:
        return text_token_ids(None, NUM_TOKENS)
    except Exception as error:  # noqa: BLE001 -- any failure to load the tokenizer: use the file if there is one
        path = os.environ.get(TOKENS_FILE_VARIABLE)
        if not path:
            pytest.skip(f"the tokenizer cannot load ({error!r}) and {TOKENS_FILE_VARIABLE} is not set")
        return cut_tokens(read_tokens_file(path), NUM_TOKENS)


@pytest.fixture(scope="module")
def result(fp8_device):
    return measure_fp8_accuracy(_token_ids(), AccuracyOptions(device=fp8_device))


def test_result_shape(result):
    assert result["tokens"] == NUM_TOKENS
    assert 1.0 < result["bf16_perplexity"] < 100.0  # a real model on English text
    for name in GATES:
        assert set(result[name]) >= {"perplexity_ratio", "kl", "top1_agreement"}
        assert result[name]["kl"] >= 0.0


@pytest.mark.parametrize("name", list(GATES))
def test_within_the_gate(result, name):
    gate, metrics = GATES[name], result[name]
    assert metrics["perplexity_ratio"] <= gate.max_perplexity_ratio, metrics
    assert metrics["top1_agreement"] >= gate.min_top1_agreement, metrics


def _fa3_ready() -> bool:
    return torch.cuda.get_device_capability() == (9, 0) and importlib.util.find_spec("flashinfer") is not None


def test_fp8_kv_with_fa3_prompt_attention_within_the_gate(fp8_device):
    """The FP8-KV variant with every 512-token chunk's attention in FA3's FP8 products (xqa, dense
    calls from 512 rows as on heads of 128): within the same gate."""
    if not _fa3_ready():
        pytest.skip("FA3 runs on a Hopper GPU with FlashInfer installed")
    options = AccuracyOptions(device=fp8_device, attention_backend="xqa", fa3_min_rows=512)
    variant = next(variant for variant in FP8_VARIANTS if variant.kv_cache_dtype == "fp8")
    metrics = measure_fp8_accuracy(_token_ids(), options, variants=[variant])[variant.name]
    assert metrics["perplexity_ratio"] <= GATES[variant.name].max_perplexity_ratio, metrics
    assert metrics["top1_agreement"] >= GATES[variant.name].min_top1_agreement, metrics
