"""A batch job's echo (/v1/completions: the prompt's text, and with logprobs its tokens' logprobs,
before the completion's) and prompt_logprobs (vLLM's field), on the default model."""

import json

import pytest

pytest_plugins = ["model_fixtures"]

PROMPT = "1, 2, 3,"


def _line(custom_id, url, **body):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"max_tokens": 3, "temperature": 0, **body}}


@pytest.mark.default_model
def test_echo_and_prompt_logprobs_in_the_output(tmp_path, cli_default_engine):
    from batchllm.cli.main import main

    lines = [
        _line("plain", "/v1/completions", prompt=PROMPT, logprobs=2),
        _line("echo", "/v1/completions", prompt=PROMPT, echo=True),
        _line("echo_logprobs", "/v1/completions", prompt=PROMPT, echo=True, logprobs=2),
        _line("chat", "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], prompt_logprobs=1),
    ]
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["run", str(source), "-o", str(output), "--dtype", "float32", "--device", "cpu"]) == 0
    bodies = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, output.read_text().splitlines())}
    plain = bodies["plain"]["choices"][0]
    assert "prompt_logprobs" not in plain and "prompt_logprobs" not in bodies["plain"]

    echo = bodies["echo"]["choices"][0]
    assert (echo["text"], echo["logprobs"]) == (PROMPT + plain["text"], None) and "prompt_logprobs" not in echo

    scored = bodies["echo_logprobs"]["choices"][0]
    num_prompt_tokens = bodies["echo_logprobs"]["usage"]["prompt_tokens"]
    assert bodies["echo_logprobs"]["usage"] == bodies["plain"]["usage"]  # echo counts no extra tokens
    lp = scored["logprobs"]
    assert scored["text"] == PROMPT + plain["text"] == "".join(lp["tokens"])
    assert lp["tokens"][num_prompt_tokens:] == plain["logprobs"]["tokens"]
    # (the plain request shares its prompt's KV with another: the same values up to float32 rounding)
    assert lp["token_logprobs"][num_prompt_tokens:] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-5)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # the first token has no context
    assert all(isinstance(v, float) and v <= 0 for v in lp["token_logprobs"][1:])
    assert all(2 <= len(top) <= 3 and top[token] == value for token, value, top in
               zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]))
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    # vLLM's prompt_logprobs field too: the same values by token id, with ranks
    prompt_logprobs = scored["prompt_logprobs"]
    assert len(prompt_logprobs) == num_prompt_tokens and prompt_logprobs[0] is None
    for value, entry in zip(lp["token_logprobs"][1:], prompt_logprobs[1:]):
        first = next(iter(entry.values()))  # the prompt's token first
        assert first["logprob"] == value and first["rank"] >= 1
        ranks = sorted(e["rank"] for e in entry.values())  # the top two, and the prompt's token if not one of them
        assert ranks[:2] == [1, 2] and (len(entry) == 2 or ranks[2] == first["rank"] > 2)

    chat = bodies["chat"]
    entries = chat["prompt_logprobs"]  # on the body for chat, as vLLM
    assert len(entries) == chat["usage"]["prompt_tokens"] and entries[0] is None
    assert all(1 <= len(entry) <= 2 for entry in entries[1:])
    assert "prompt_logprobs" not in chat["choices"][0]
