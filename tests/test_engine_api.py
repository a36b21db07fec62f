"""Python API and CLI round trip on the default model; sampling determinism with seeds."""

import json

import pytest
import torch

from batchllm import SamplingParams
from batchllm.ops.reference import paged_attention_reference, store_kv_reference
from op_references import dense_causal_attention


pytest_plugins = ["model_fixtures"]


@pytest.fixture
def llm(default_llm):
    return default_llm  # the default model, float32 on CPU, 4096 KV tokens


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=1234, ignore_eos=True)
    alone = llm.generate(["Write a word:"], params, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(["Tell me a story about a cat", "Write a word:", "1 2 3"],
                         [SamplingParams(temperature=1.0, max_tokens=5), params, SamplingParams(temperature=0, max_tokens=3)],
                         use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    other_seed = llm.generate(["Write a word:"], SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=99,
                                                                ignore_eos=True), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone


def test_stop_strings_max_tokens_and_logprobs(llm):
    out = llm.generate("1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=30, stop=[" 8"], logprobs=2),
                       use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "stop"
    assert completion.text == " 6, 7,"
    assert len(completion.logprobs) == len(completion.token_ids)
    assert all(len(entry) >= 2 for entry in completion.logprobs)
    assert completion.cumulative_logprob < 0
    length = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert length.outputs[0].finish_reason == "length" and len(length.outputs[0].token_ids) == 3


def test_chat_uses_the_template_and_stops_at_eos(llm):
    (out,) = llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0, max_tokens=64),
                      use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids[-1] in llm.engine.eos_token_ids
    assert "<|im_end|>" not in out.outputs[0].text and out.outputs[0].text.strip()


def test_prompt_too_long_is_rejected(llm):
    with pytest.raises(ValueError, match="prompt has"):
        llm.generate([[1] * 5000], SamplingParams(max_tokens=2), use_tqdm=False)


def test_paged_reference_equals_dense_attention():
    torch.manual_seed(0)
    block_size, num_kv_heads, num_heads, head_dim = 4, 2, 6, 8
    k_cache = torch.zeros(16, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    # seq 0: 7 KV positions, the last 3 are new rows; seq 1: shared prefix of 5 (blocks 3, 4) + 2 own (block 9).
    keys = [torch.randn(7, num_kv_heads, head_dim), torch.randn(7, num_kv_heads, head_dim)]
    values = [torch.randn(7, num_kv_heads, head_dim), torch.randn(7, num_kv_heads, head_dim)]
    slots0 = [b * block_size + o for b in (6, 2) for o in range(block_size)][:7]
    slots1 = [3 * 4 + o for o in range(4)] + [4 * 4] + [9 * 4, 9 * 4 + 1]
    for k, v, slots in ((keys[0], values[0], slots0), (keys[1], values[1], slots1)):
        store_kv_reference(k, v, k_cache, v_cache, torch.tensor(slots))
    query = torch.randn(3 + 2, num_heads, head_dim)
    out = paged_attention_reference(
        query, k_cache, v_cache, torch.tensor([0, 3, 5]), torch.tensor([7, 7]), torch.tensor([0, 5]),
        torch.tensor([[6, 2, 0], [3, 4, 9]]), scale=0.3)
    assert torch.allclose(out[:3], dense_causal_attention(query[:3], keys[0], values[0], 0.3), atol=1e-5)
    assert torch.allclose(out[3:], dense_causal_attention(query[3:], keys[1], values[1], 0.3), atol=1e-5)


@pytest.mark.default_model
def test_cli_round_trip(tmp_path, capsys, cli_default_engine):
    from batchllm.cli.main import main

    lines = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}},
        {"custom_id": "bad", "prompt": "x", "temperature": -1},
        {"custom_id": "comp", "prompt": "The sky is", "max_tokens": 5, "temperature": 0},
        {"custom_id": "ids", "prompt_token_ids": [42, 17, 999], "max_tokens": 4, "ignore_eos": True},
    ]
    input_path = tmp_path / "in.jsonl"
    input_path.write_text("\n".join(json.dumps(line) for line in lines) + "\n{broken\n")
    output_path = tmp_path / "out.jsonl"
    code = main(["run", str(input_path), "-o", str(output_path), "--no-progress", "--kv-cache-tokens", "2048"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "3 requests answered, 2 errors" in out
    assert [config.model for config in cli_default_engine] == [None]  # the default model ran
    records = [json.loads(line) for line in output_path.read_text().splitlines()]
    assert [r["custom_id"] for r in records] == ["chat", "bad", "comp", "ids", None]
    chat, bad, comp, ids, broken = records
    assert chat["response"]["body"]["object"] == "chat.completion"
    assert chat["response"]["body"]["choices"][0]["message"]["role"] == "assistant"
    assert comp["response"]["body"]["object"] == "text_completion"
    assert comp["response"]["body"]["usage"]["completion_tokens"] == 5
    assert ids["response"]["body"]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                                                "prompt_tokens_details": {"cached_tokens": 0}}
    assert bad["response"] is None and bad["error"]["code"] == "invalid_sampling" and bad["error"]["line"] == 2
    assert broken["error"]["code"] == "invalid_json" and broken["error"]["line"] == 5
    assert not (tmp_path / "out.jsonl.partial").exists()
