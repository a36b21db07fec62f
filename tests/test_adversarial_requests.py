"""Requests an adversarial user would send to the sampler: every sampling field with every JSON
type, logprobs counted and shaped as OpenAI does, and logit_bias."""

import json
import math

import pytest
import torch

from batchllm.engine.sampler import SamplingBatch, sample, sampling_row
from batchllm.io.batch_output import openai_logprobs
from batchllm.models.token_bytes import VocabularyBytes
from batchllm.sampling_params import SamplingParams, SamplingParamsError

pytest_plugins = ["model_fixtures"]

JSON_VALUES = [None, True, False, 0, 1, -1, 7, 2**40, 0.5, -0.5, 1.5, 1e308, "", "5", "x", [], [1], ["a"],
               {}, {"1": 2}]
FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
          "include_stop_str_in_output", "logprobs", "n", "logit_bias"]
VOCAB = 64


@pytest.mark.parametrize("field", FIELDS)
def test_every_field_with_every_json_type_is_valid_or_a_sampling_error(field):
    """A value is either rejected with SamplingParamsError or samples without an exception."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    for value in JSON_VALUES:
        try:
            params = SamplingParams(**{field: value})
        except SamplingParamsError:
            continue
        out = sample(logits, SamplingBatch.build([sampling_row(params, 3, 0)], torch.device("cpu")))
        assert 0 <= int(out.token_ids[0]) < VOCAB, (field, value)


@pytest.mark.parametrize("value", [True, False, 1.0, "5", 21, -1])
def test_logprobs_must_be_an_integer_not_a_bool(value):
    with pytest.raises(SamplingParamsError, match="logprobs"):
        SamplingParams(logprobs=value)


def test_top_logprobs_are_the_top_k_whether_or_not_the_sampled_token_is_among_them():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -9.0]])
    # Seeded sampling with a bias that forces token 7 (far below the top 5).
    params = SamplingParams(temperature=1.0, seed=1, logprobs=5, logit_bias={"7": 100})
    out = sample(logits, SamplingBatch.build([sampling_row(params, 1, 0)], torch.device("cpu")))
    assert out.token_ids.tolist() == [7]
    assert out.top_token_ids.tolist() == [[0, 1, 2, 3, 4]]
    log_probs = torch.log_softmax(logits, -1)[0]
    assert out.logprobs.item() == pytest.approx(log_probs[7].item())  # the model's distribution, not the biased one
    entry = {7: out.logprobs.item(), **dict(zip(out.top_token_ids[0].tolist(), out.top_logprobs[0].tolist()))}
    content = openai_logprobs("chat", [7], [entry], 5, _vocabulary(str), "7")["content"][0]
    assert content["token"] == "7" and content["logprob"] == pytest.approx(log_probs[7].item())
    assert [t["token"] for t in content["top_logprobs"]] == ["0", "1", "2", "3", "4"]


def _vocabulary(text_of, size=VOCAB, skipped_ids=()):
    return VocabularyBytes(tuple(text_of(t).encode() for t in range(size)), frozenset(skipped_ids))


def test_chat_top_logprobs_keep_the_sampled_token_when_it_is_in_the_top():
    entry = {2: -0.5, 1: -0.2, 3: -3.0, 4: -4.0, 5: -5.0}  # sampled 2, in the top 5
    content = openai_logprobs("chat", [2], [entry], 5, _vocabulary(lambda t: "tok" + str(t)), "tok2")["content"][0]
    assert [(t["token"], t["logprob"]) for t in content["top_logprobs"]] == [
        ("tok1", -0.2), ("tok2", -0.5), ("tok3", -3.0), ("tok4", -4.0), ("tok5", -5.0)]
    assert content["bytes"] == list(b"tok2")
    assert content["top_logprobs"][0]["bytes"] == list(b"tok1")


def test_chat_top_logprobs_zero_gives_empty_lists():
    content = openai_logprobs("chat", [9, 8], [{9: -1.0}, {8: -2.0}], 0, _vocabulary(str), "98")["content"]
    assert [c["top_logprobs"] for c in content] == [[], []]
    assert [c["logprob"] for c in content] == [-1.0, -2.0]


def test_completions_logprobs_have_the_completions_shape():
    texts = {10: "Hello", 11: ",", 12: " wor", 13: "ld", 14: " x"}
    vocabulary = _vocabulary(lambda t: texts.get(t, "?"))
    entries = [{10: -0.1, 14: -3.0}, {11: -0.2, 14: -2.5}, {12: -4.0, 13: -1.0, 14: -2.0}]  # last: sampled outside
    shape = openai_logprobs("completion", [10, 11, 12], entries, 2, vocabulary, "Hello, wor")
    assert shape == {
        "tokens": ["Hello", ",", " wor"],
        "token_logprobs": [-0.1, -0.2, -4.0],
        "top_logprobs": [{"Hello": -0.1, " x": -3.0}, {",": -0.2, " x": -2.5},
                         {"ld": -1.0, " x": -2.0, " wor": -4.0}],
        "text_offset": [0, 5, 6],
    }


def test_logit_bias_moves_greedy_and_stays_per_row():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    top = logits.argmax(-1).tolist()
    rows = [sampling_row(SamplingParams(temperature=0, logit_bias={"5": 100}), 0, 0),
            sampling_row(SamplingParams(temperature=0), 0, 0),
            sampling_row(SamplingParams(temperature=0, logit_bias={top[2]: -100, 10**9: 50}), 0, 0)]
    out = sample(logits, SamplingBatch.build(rows, torch.device("cpu"))).token_ids.tolist()
    second = logits[2].clone()
    second[top[2]] -= 100
    assert out == [5, top[1], int(second.argmax())]


def test_logit_bias_steers_seeded_sampling():
    logits = torch.zeros(1, VOCAB)
    allowed = {3, 17, 40}
    bias = {t: (0 if t in allowed else -100) for t in range(VOCAB)}
    seen = set()
    for index in range(60):
        params = SamplingParams(temperature=1.0, logit_bias=bias)
        seen.add(int(sample(logits, SamplingBatch.build([sampling_row(params, 11, index)],
                                                        torch.device("cpu"))).token_ids[0]))
    assert seen == allowed


@pytest.mark.parametrize("bias", [{"a": 1}, {"-1": 1}, {"1": 101}, {"1": -100.5}, {"1": "3"}, {"1": True},
                                  {"1": math.nan}, [1, 2], "x", {1: 1, "1": 2}])
def test_bad_logit_bias_is_a_sampling_error(bias):
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_logit_bias_is_held_hashable_and_sorted():
    params = SamplingParams(logit_bias={"20": -1, 3: 2.5})
    assert params.logit_bias == ((3, 2.5), (20, -1.0))
    assert hash(params) == hash(SamplingParams(logit_bias={3: 2.5, 20: -1}))
    assert SamplingParams(logit_bias={}).logit_bias is None


@pytest.mark.default_model
def test_batch_job_writes_each_endpoint_shape(tmp_path, cli_default_engine):
    """The default model end to end: completions shape for /v1/completions, chat shape with
    exactly top_logprobs entries for chat."""
    from batchllm.cli.main import main

    lines = [
        {"custom_id": "c", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "1, 2, 3,", "max_tokens": 4, "temperature": 0, "logprobs": 3}},
        {"custom_id": "h", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0,
                  "logprobs": True, "top_logprobs": 5}},
    ]
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["run", str(source), "-o", str(output), "--dtype", "float32", "--device", "cpu"]) == 0
    assert len(cli_default_engine) == 1  # the default model ran
    records = {r["custom_id"]: r for r in map(json.loads, output.read_text().splitlines())}
    completion = records["c"]["response"]["body"]["choices"][0]
    lp = completion["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert "".join(lp["tokens"]) == completion["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert all(3 <= len(top) <= 4 for top in lp["top_logprobs"])
    for token, token_lp, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[token] == token_lp  # greedy: the sampled token is the top one
    content = records["h"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert len(entry["top_logprobs"]) == 5
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy
        logprobs = [t["logprob"] for t in entry["top_logprobs"]]
        assert logprobs == sorted(logprobs, reverse=True)


def test_input_lines_carry_logit_bias_to_the_sampler():
    from batchllm.io.batch_input import BatchError
    from io_helpers import parse_lines

    good = {"custom_id": "b", "prompt_token_ids": [5], "logit_bias": {"7": -100, "3": 5}}
    bad = {"custom_id": "c", "prompt_token_ids": [5], "logit_bias": {"7": 300}}
    request, error = parse_lines([json.dumps(good), json.dumps(bad)])
    assert request.sampling.logit_bias == ((3, 5.0), (7, -100.0)) and not request.warnings
    assert isinstance(error, BatchError) and error.code == "invalid_sampling" and "logit_bias" in error.message


@pytest.mark.default_model
def test_multi_byte_tokens_give_real_bytes_distinct_keys_and_offsets_in_the_text(tmp_path, cli_default_engine):
    """Regression: every emoji token's bytes were U+FFFD's, completions top_logprobs keys collapsed
    to "�" (the sampled token's logprob overwritten) and text_offset ran past the text."""
    from batchllm.cli.main import main

    lines = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Give me three emojis about the sea."}], "max_tokens": 6,
                  "temperature": 0, "logprobs": True, "top_logprobs": 2}},
        {"custom_id": "text", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "My favourite emoji is", "max_tokens": 8, "temperature": 0, "logprobs": 3}},
    ]
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["run", str(source), "-o", str(output), "--dtype", "float32", "--device", "cpu", "--no-progress"]) == 0
    records = {r["custom_id"]: r["response"]["body"]["choices"][0] for r in map(json.loads, output.read_text().splitlines())}
    chat = records["chat"]
    assert chat["message"]["content"] == "🌪🌪"
    content = chat["logprobs"]["content"]
    assert [c["bytes"] for c in content] == [[0xF0, 0x9F], [0x8C], [0xAA]] * 2
    assert [c["token"] for c in content] == ["bytes:\\xf0\\x9f", "bytes:\\x8c", "bytes:\\xaa"] * 2
    assert bytes(b for c in content for b in c["bytes"]) == chat["message"]["content"].encode()
    assert all(c["top_logprobs"][0]["bytes"] == c["bytes"] for c in content)  # greedy: the top token
    text = records["text"]
    assert text["text"] == ":\n\n🌱\ufffd"  # max_tokens ends inside the second emoji
    logprobs = text["logprobs"]
    assert logprobs["tokens"] == [":", "\n", "\n", "bytes:\\xf0\\x9f", "bytes:\\x8c", "bytes:\\xb1",
                                  "bytes:\\xf0\\x9f", "bytes:\\x8c"]
    assert logprobs["text_offset"] == [0, 1, 2, 3, 3, 3, 4, 4]
    for token, token_logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert len(top) == 3 and top[token] == token_logprob == max(top.values())


@pytest.mark.parametrize("url, asked", [("/v1/completions", {"logprobs": 2}),
                                        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2})])
def test_logprobs_without_a_tokenizer_are_token_ids(tmp_path, url, asked):
    """Regression: a model without a tokenizer answered logprobs with null."""
    from batchllm.cli.main import main

    body = {"prompt_token_ids": [5, 6, 7], "max_tokens": 3, "temperature": 0, **asked}
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": url, "body": body}) + "\n")
    assert main(["run", str(source), "-o", str(output), "--model", "random:tiny", "--device", "cpu",
                 "--kv-cache-tokens", "256", "--no-progress"]) == 0
    choice = json.loads(output.read_text())["response"]["body"]["choices"][0]
    if url == "/v1/completions":
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == 3 and all(t.startswith("token_id:") for t in lp["tokens"])
        assert lp["text_offset"] == [0, 0, 0] and all(len(top) == 2 for top in lp["top_logprobs"])
        assert [top[t] for t, top in zip(lp["tokens"], lp["top_logprobs"])] == lp["token_logprobs"]
    else:
        content = choice["logprobs"]["content"]
        assert len(content) == 3 and all(c["token"].startswith("token_id:") and c["bytes"] is None for c in content)
        assert all(c["top_logprobs"][0]["token"] == c["token"] for c in content)  # greedy
