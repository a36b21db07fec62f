"""n samples per prompt and the answer's token ids (random:tiny, float32 on CPU, token-id prompts):
the samples of a prompt are one prefix group whose prompt is computed once; LLM.generate returns
n CompletionOutputs; a job's record has choices 0..n-1 that the openai SDK's types accept, usage
counting the prompt once, and (without a tokenizer, or with return_token_ids) the token ids."""

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from batchllm import LLM, SamplingParams
from batchllm.engine.request_state import FinishedOutput, PreparedRequest
from batchllm.engine.samples import SampleSplit
from batchllm.job.batch_job import BatchJobOptions, run_batch_file
from batchllm.prefix.planner import plan_prefix_groups
from batchllm.sampling_params import sample_seed

pytest_plugins = ["model_fixtures"]

PROMPT = [(7 * i + 3) % 500 for i in range(40)]  # 40 tokens: a 39-token prefix spans blocks of 16
SAMPLED = dict(temperature=1.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM("random:tiny", dtype="float32", device="cpu", kv_cache_tokens=4096)


def _ids(output):
    return [c.token_ids for c in output.outputs]


def test_samples_of_a_prompt_are_one_group_and_its_prompt_is_prefilled_once(llm):
    split = SampleSplit(engine_seed=0, first_free_id=2)
    requests = [PreparedRequest(0, PROMPT, SamplingParams(n=4, **SAMPLED)),
                PreparedRequest(1, PROMPT[:20] + [1, 2], SamplingParams(**SAMPLED))]
    samples = [sample for request in requests for sample in split.split(request)]
    assert [s.request_id for s in samples] == [0, 2, 3, 4, 1] and all(s.params.n == 1 for s in samples)
    plan = plan_prefix_groups([s.prompt_token_ids for s in samples])
    groups = {g.request_indices: (len(g.prefix_token_ids), g.distinct_token_ids) for g in plan.groups}
    # the four samples: one group, prefix = the prompt less its last token, one own token each
    assert groups[(0, 1, 2, 3)] == (39, ((PROMPT[-1],),) * 4)
    (output,) = llm.generate([PROMPT], SamplingParams(n=4, **SAMPLED), use_tqdm=False)
    records = llm.last_run_stats.step_records
    assert sum(r.num_prefix_tokens for r in records) == 39  # the shared prompt, computed once
    assert sum(r.num_distinct_tokens for r in records) == 4  # each sample's last prompt token
    assert sum(r.num_decode_tokens for r in records) == 4 * 5
    assert [c.index for c in output.outputs] == [0, 1, 2, 3] and output.prompt_token_ids == PROMPT


def test_seeded_samples_are_reproducible_and_sample_0_is_the_n1_answer(llm):
    (four,) = llm.generate([PROMPT], SamplingParams(n=4, seed=11, **SAMPLED), use_tqdm=False)
    ids = _ids(four)
    assert len({tuple(t) for t in ids}) == 4 and all(len(t) == 6 for t in ids)  # samples differ
    each = llm.generate([PROMPT] * 4, [SamplingParams(seed=sample_seed(11, k), **SAMPLED) for k in range(4)],
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in each] == ids  # sample k: seed sample_seed(11, k); sample 0: 11
    (again,) = llm.generate([PROMPT], SamplingParams(n=4, seed=11, **SAMPLED), use_tqdm=False)
    assert _ids(again) == ids
    (two,) = llm.generate([PROMPT], SamplingParams(n=2, seed=11, **SAMPLED), use_tqdm=False)
    assert _ids(two) == ids[:2]


def test_unseeded_samples_differ_and_greedy_samples_are_equal(llm):
    (free,) = llm.generate([PROMPT], SamplingParams(n=3, **SAMPLED), use_tqdm=False)
    assert len({tuple(t) for t in _ids(free)}) == 3
    (single,) = llm.generate([PROMPT], SamplingParams(**SAMPLED), use_tqdm=False)
    assert single.outputs[0].token_ids == free.outputs[0].token_ids  # the engine's seed for request 0
    greedy = dict(SAMPLED, temperature=0)
    (same,) = llm.generate([PROMPT], SamplingParams(n=3, logprobs=1, **greedy), use_tqdm=False)
    (one,) = llm.generate([PROMPT], SamplingParams(logprobs=1, **greedy), use_tqdm=False)
    assert _ids(same) == [one.outputs[0].token_ids] * 3
    assert [c.finish_reason for c in same.outputs] == ["length"] * 3
    # Equal ids; logprobs equal to float32 rounding (three rows and one round their products
    # differently on some CPUs).
    for c in same.outputs:
        assert [list(entry) for entry in c.logprobs] == [list(entry) for entry in one.outputs[0].logprobs]
        assert [v for entry in c.logprobs for v in entry.values()] == pytest.approx(
            [v for entry in one.outputs[0].logprobs for v in entry.values()], rel=1e-5)
        assert c.cumulative_logprob == pytest.approx(one.outputs[0].cumulative_logprob, rel=1e-5)


def test_gather_returns_a_request_once_all_its_samples_finished():
    split = SampleSplit(engine_seed=0, first_free_id=10)
    samples = split.split(PreparedRequest(3, [5, 6], SamplingParams(n=3, seed=4)))
    assert [(s.request_id, s.params.seed) for s in samples] == [(3, 4), (10, sample_seed(4, 1)),
                                                                 (11, sample_seed(4, 2))]
    done = {s.request_id: FinishedOutput(s.request_id, [5, 6], [s.request_id], "", "length") for s in samples}
    assert split.gather(done[11]) is None and split.gather(done[3]) is None
    request_id, outputs = split.gather(done[10])
    assert request_id == 3 and [(o.request_id, o.output_token_ids) for o in outputs] == [(3, [3]), (3, [10]),
                                                                                        (3, [11])]
    (alone,) = split.split(PreparedRequest(4, [5], SamplingParams()))
    assert split.gather(FinishedOutput(4, [5], [9], "", "stop")) == (4, [FinishedOutput(4, [5], [9], "", "stop")])


def _write(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def _records(path):
    return {r["custom_id"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_a_job_line_of_n_samples_is_one_record_the_openai_types_accept(llm, tmp_path):
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    body = {"prompt_token_ids": PROMPT, "max_tokens": 6, "ignore_eos": True, "seed": 5}
    _write(input_path, [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {**body, "n": 3, "logprobs": True, "top_logprobs": 2}},
        {"custom_id": "text", "method": "POST", "url": "/v1/completions", "body": {**body, "n": 2, "best_of": 2}},
        {"custom_id": "one", "method": "POST", "url": "/v1/completions", "body": {**body, "return_token_ids": False}},
    ])
    summary = run_batch_file(llm.engine, str(input_path), str(output_path), BatchJobOptions(show_progress=False))
    assert (summary.num_requests, summary.num_errors) == (3, 0)
    (expected,) = llm.generate([PROMPT], SamplingParams(n=3, seed=5, max_tokens=6, ignore_eos=True), use_tqdm=False)
    records = _records(output_path)

    chat = ChatCompletion.model_validate(records["chat"]["response"]["body"])
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert [c.token_ids for c in chat.choices] == _ids(expected)  # vLLM's return_token_ids, on by default here
    assert chat.prompt_token_ids == PROMPT  # on the chat body (vLLM)
    assert [c.finish_reason for c in chat.choices] == ["length"] * 3
    assert [[t.token for t in c.logprobs.content] for c in chat.choices] == [
        [f"token_id:{t}" for t in ids] for ids in _ids(expected)]
    assert all(len(t.top_logprobs) == 2 for c in chat.choices for t in c.logprobs.content)
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens) == (40, 18, 58)

    text = Completion.model_validate(records["text"]["response"]["body"])
    assert [c.index for c in text.choices] == [0, 1] and [c.text for c in text.choices] == ["", ""]
    assert [c.token_ids for c in text.choices] == _ids(expected)[:2]
    assert [c.prompt_token_ids for c in text.choices] == [PROMPT, PROMPT]  # on each choice (vLLM)
    assert (text.usage.prompt_tokens, text.usage.completion_tokens) == (40, 12)

    one = records["one"]["response"]["body"]
    Completion.model_validate(one)
    assert "token_ids" not in one["choices"][0] and "prompt_token_ids" not in one["choices"][0]
    assert (one["usage"]["prompt_tokens"], one["usage"]["completion_tokens"]) == (40, 6)


class _FailingSample:
    """The engine, with the output of one engine request (a sample) turned into a failure."""

    def __init__(self, engine, failing_request_id):
        self._engine, self._failing = engine, failing_request_id
        self.calls = []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def run(self, requests, **kwargs):
        self.calls.append([r.request_id for r in requests])
        for done in self._engine.run(requests, **kwargs):
            if done.request_id == self._failing:
                done.error, done.finish_reason = "internal_error: RuntimeError: boom", "error"
            yield done


def test_a_failing_sample_fails_its_line_with_one_error_record(llm, tmp_path):
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    line = {"prompt_token_ids": [5, 6, 7], "max_tokens": 3, "temperature": 1.0, "ignore_eos": True}
    _write(input_path, [{"custom_id": "a", **line, "n": 3}, {"custom_id": "b", **line, "n": 2}])
    engine = _FailingSample(llm.engine, failing_request_id=4)  # ids 1, 2: lines; 3, 4: samples 1, 2 of line 1
    summary = run_batch_file(engine, str(input_path), str(output_path), BatchJobOptions(show_progress=False))
    assert engine.calls == [[1, 3, 4, 2, 5]]
    assert (summary.num_requests, summary.num_errors) == (1, 1)
    lines = [json.loads(x) for x in output_path.read_text().splitlines()]
    assert [r["custom_id"] for r in lines] == ["a", "b"]
    assert lines[0]["response"] is None
    assert lines[0]["error"] == {"code": "internal_error", "message": "internal_error: RuntimeError: boom", "line": 1}
    assert len(lines[1]["response"]["body"]["choices"]) == 2


def test_the_window_counts_samples_and_keeps_a_line_whole(llm, tmp_path):
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    line = {"prompt_token_ids": [5, 6, 7], "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    _write(input_path, [{"custom_id": "a", **line, "n": 3}, {"custom_id": "b", **line, "n": 3},
                        {"custom_id": "c", **line}])
    engine = _FailingSample(llm.engine, failing_request_id=-1)
    options = BatchJobOptions(show_progress=False, window_num_requests=4)
    summary = run_batch_file(engine, str(input_path), str(output_path), options)
    assert engine.calls == [[1, 3, 4, 2, 5, 6], [3]]  # 3 + 3 samples reach the window of 4; then c
    assert (summary.num_requests, summary.num_errors) == (3, 0)
    choices = {k: r["response"]["body"]["choices"] for k, r in _records(output_path).items()}
    assert [len(choices[k]) for k in "abc"] == [3, 3, 1]
    assert len({tuple(c["token_ids"]) for k in "abc" for c in choices[k]}) == 1  # greedy: one answer


def test_return_token_ids_on_a_model_with_a_tokenizer(default_engine, tmp_path):
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    body = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 5, "temperature": 0}
    _write(input_path, [{"custom_id": "ids", "method": "POST", "url": "/v1/chat/completions",
                         "body": {**body, "return_token_ids": True}},
                        {"custom_id": "plain", "method": "POST", "url": "/v1/chat/completions", "body": body}])
    run_batch_file(default_engine, str(input_path), str(output_path), BatchJobOptions(show_progress=False))
    records = _records(output_path)
    with_ids = ChatCompletion.model_validate(records["ids"]["response"]["body"])
    tokenizer = default_engine.tokenizer
    prompt_ids = tokenizer.encode_chat(body["messages"])
    assert with_ids.prompt_token_ids == prompt_ids and with_ids.usage.prompt_tokens == len(prompt_ids)
    (choice,) = with_ids.choices
    assert len(choice.token_ids) == with_ids.usage.completion_tokens == 5
    assert tokenizer.decode(choice.token_ids) == choice.message.content != ""
    plain = records["plain"]["response"]["body"]
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    assert plain["choices"][0]["message"] == with_ids.choices[0].message.model_dump(exclude_none=True)


class _RaisingOnSample:
    """The engine, raising (as a kernel failure would) when the samples of one prompt run."""

    def __init__(self, engine, prompt):
        self._engine, self._prompt = engine, prompt
        self.calls = []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def run(self, requests, **kwargs):
        self.calls.append([r.request_id for r in requests])
        if sum(r.prompt_token_ids == self._prompt for r in requests) > 1:
            raise RuntimeError("kernel failed")
        yield from self._engine.run(requests, **kwargs)


def test_an_engine_failure_in_a_sample_fails_only_its_line(llm, tmp_path):
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    line = {"max_tokens": 3, "temperature": 1.0, "ignore_eos": True}
    _write(input_path, [{"custom_id": "a", "prompt_token_ids": [5, 6, 7], "n": 2, **line},
                        {"custom_id": "b", "prompt_token_ids": [8, 9], "n": 2, **line},
                        {"custom_id": "c", "prompt_token_ids": [8, 9], **line}])
    engine = _RaisingOnSample(llm.engine, [5, 6, 7])
    summary = run_batch_file(engine, str(input_path), str(output_path), BatchJobOptions(show_progress=False))
    # all three lines, then halves: [a] alone fails, [b, c] runs again (a line's samples stay together)
    assert engine.calls == [[1, 4, 2, 5, 3], [1, 2], [2, 4, 3]]
    records = _records(output_path)
    assert (summary.num_requests, summary.num_errors) == (2, 1)
    assert records["a"]["error"] == {"code": "internal_error", "message": "RuntimeError: kernel failed", "line": 1}
    assert [len(records[k]["response"]["body"]["choices"]) for k in "bc"] == [2, 1]


def test_simulate_runs_a_lines_n_samples_as_run_does(tmp_path, capsys):
    from batchllm.cli.main import main

    source = tmp_path / "in.jsonl"
    _write(source, [{"custom_id": "a", "prompt_token_ids": PROMPT, "max_tokens": 4, "n": 3},
                    {"custom_id": "b", "prompt_token_ids": [1, 2, 3], "max_tokens": 4}])
    assert main(["simulate", str(source), "--kv-cache-tokens", "4096", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["finished_requests"] == 4
    assert report["processed_prefill_tokens"] == 39 + 3 + 3  # the prompt once, its last token per sample; b


def test_n_samples_with_echo_and_prompt_logprobs_share_the_prompts_fields(llm, tmp_path):
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    body = {"prompt": PROMPT[:6], "max_tokens": 3, "ignore_eos": True, "seed": 2, "logprobs": 1}
    _write(input_path, [
        {"custom_id": "echo", "method": "POST", "url": "/v1/completions", "body": {**body, "n": 3, "echo": True}},
        {"custom_id": "one", "method": "POST", "url": "/v1/completions", "body": {**body, "echo": True}},
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"prompt_token_ids": PROMPT[:6], "max_tokens": 3, "n": 2, "prompt_logprobs": 1}},
    ])
    summary = run_batch_file(llm.engine, str(input_path), str(output_path), BatchJobOptions(show_progress=False))
    assert (summary.num_requests, summary.num_errors) == (3, 0)
    records = _records(output_path)
    echo = records["echo"]["response"]["body"]  # (echo's first logprob is null, which the SDK's type refuses)
    one = records["one"]["response"]["body"]["choices"][0]
    choices = echo["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2] and len({tuple(c["token_ids"]) for c in choices}) == 3
    assert choices[0]["token_ids"] == one["token_ids"]  # sample 0 is the n=1 answer
    for c in choices:  # the prompt's fields: the same on every choice, the prompt's tokens first in the logprobs
        assert c["prompt_logprobs"] == one["prompt_logprobs"] and len(c["prompt_logprobs"]) == 6
        assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in PROMPT[:6] + c["token_ids"]]
        assert c["logprobs"]["token_logprobs"][:6] == one["logprobs"]["token_logprobs"][:6]
    chat = ChatCompletion.model_validate(records["chat"]["response"]["body"]).model_dump()
    assert len(chat["prompt_logprobs"]) == 6 and chat["prompt_logprobs"][0] is None
    assert all("prompt_logprobs" not in c for c in records["chat"]["response"]["body"]["choices"])
