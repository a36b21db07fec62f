"""Jobs driven as an adversarial user would: inputs edited between a crash and the resume,
options changed on resume, forged journal records, two jobs on one output, outputs that are the
input, unusable paths, huge lines, every sampling field with every JSON type, a failing
request, BOMs, double signals. Each case ends with the right output, or exit 2 and a message
naming the fix, before any work (random:tiny: token-id prompts, no tokenizer)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from batchllm.job.batch_job import BatchJobOptions, run_batch_file
from batchllm.cli.main import main
from batchllm.config import engine_config
from batchllm.engine.llm_engine import LLMEngine
from batchllm.io.batch_input import read_lines
from batchllm.io.compact_set import digest64
from batchllm.io.job_files import JobLock
from model_helpers import normalized_records

pytest_plugins = ["model_fixtures"]

MODEL = "random:tiny"
KV_TOKENS = 256  # token limit 240: a chat line without max_tokens stays short
MISSING_MODEL = "/nonexistent/model.gguf"  # a refusal must come before the model would load
CONFIG = engine_config(MODEL, device="cpu", kv_cache_tokens=KV_TOKENS)  # the job's rules, on any machine


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(CONFIG)


def _line(i, **fields):
    return {"custom_id": f"r{i:02d}", "prompt_token_ids": [3 + i, 7 + 2 * i, 11 + 3 * i], "max_tokens": 3,
            "temperature": 0, "ignore_eos": True, **fields}


def _write(path, lines):
    path.write_bytes(b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n"
                              for line in lines))




def _num_journal_records(journal_path):
    """Record lines of a journal (the header and the engine line start with #)."""
    with open(journal_path, "rb") as handle:
        return sum(1 for line in handle if not line.startswith(b"#"))


class _StopAfterRecords:
    """A StopRequest that asks to stop once the journal holds `num_records` records."""

    def __init__(self, journal_path, num_records):
        self.journal_path, self.num_records = journal_path, num_records
        self.signal_name, self.exit_code, self.on_exit_now = None, 0, None

    @property
    def requested(self):
        if self.signal_name is None and os.path.exists(self.journal_path):
            if _num_journal_records(self.journal_path) >= self.num_records:
                    self.signal_name, self.exit_code = "SIGTERM", 143
        return self.signal_name is not None


def _options(**changes):
    return BatchJobOptions(show_progress=False, window_num_requests=1, **changes)


def _interrupted(engine, input_path, output_path, num_records):
    stop = _StopAfterRecords(str(output_path) + ".partial", num_records)
    summary = run_batch_file(engine, str(input_path), str(output_path), options=_options(), stop=stop)
    assert summary.interrupted_by == "SIGTERM" and not output_path.exists()
    return summary


def _reference(engine, tmp_path, lines, name="reference"):
    path = tmp_path / f"{name}.in.jsonl"
    _write(path, lines)
    output = tmp_path / f"{name}.jsonl"
    run_batch_file(engine, str(path), str(output), options=_options())
    return normalized_records(output)


def _run_cli(capsys, *argv):
    code = main(["run", *map(str, argv), "--device", "cpu", "--no-progress"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# -- a resume cannot mix inputs or options --------------------------------------------------


@pytest.mark.parametrize("edit", ["swap lines 9 and 10", "reverse the file", "same-length prompt edit"])
def test_an_input_edited_after_a_crash_gives_the_edited_inputs_answers(engine, tmp_path, edit):
    lines = [_line(i) for i in range(12)]
    if edit == "swap lines 9 and 10":
        edited = lines[:8] + [lines[9], lines[8]] + lines[10:]
    elif edit == "reverse the file":
        edited = lines[::-1]
    else:
        edited = [*lines[:4], _line(4, prompt_token_ids=[8, 16, 24]), *lines[5:]]
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(input_path, lines)
    _interrupted(engine, input_path, output_path, 9)
    _write(input_path, edited)
    assert os.path.getsize(input_path) == sum(len(json.dumps(x)) + 1 for x in lines)  # same byte size
    summary = run_batch_file(engine, str(input_path), str(output_path), options=_options())
    assert normalized_records(output_path) == _reference(engine, tmp_path, edited)
    assert summary.num_requests == 12 and summary.num_errors == 0


def test_resume_with_other_output_changing_options_is_refused_by_name(engine, tmp_path, capsys):
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(input_path, [_line(i) for i in range(6)])
    _interrupted(engine, input_path, output_path, 3)
    journal = (tmp_path / "out.jsonl.partial").read_bytes()
    for flag, value, shown in (("--seed", "5", "--seed 0 -> 5"), ("--dtype", "bfloat16", "--dtype 'float32' -> 'bfloat16'"),
                               ("--max-model-len", "64", "--max-model-len None -> 64"),
                               ("--max-line-bytes", "100000", "--max-line-bytes 10485760 -> 100000")):
        code, _, err = _run_cli(capsys, input_path, "-o", output_path, "--model", MODEL, flag, value)
        assert code == 2 and shown in err and "--restart" in err, err
        assert "loading model" not in err
        assert (tmp_path / "out.jsonl.partial").read_bytes() == journal  # untouched
    code, out, err = _run_cli(capsys, input_path, "-o", output_path, "--model", MODEL,
                              "--kv-cache-tokens", KV_TOKENS, "--policy", "vllm")  # how fast, not what: resumes
    assert code == 0 and "6 requests answered, 0 errors" in out and "(3 resumed from an earlier run)" in out, err


def test_forged_and_repeated_journal_records_are_dropped_and_not_counted(engine, tmp_path):
    lines = [_line(i) for i in range(12)]
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(input_path, lines)
    _interrupted(engine, input_path, output_path, 4)
    journal_path = tmp_path / "out.jsonl.partial"
    entries = [line for line in journal_path.read_bytes().splitlines(keepends=True) if not line.startswith(b"#")]
    tab = entries[0].index(b"\t")
    with open(journal_path, "ab") as handle:
        handle.write(b"40" + entries[0][tab:])  # a line number the 12-line input does not have
        handle.write(entries[1])  # the same line answered twice
    summary = run_batch_file(engine, str(input_path), str(output_path), options=_options())
    assert summary.num_requests == 12 and summary.num_resumed == 4
    assert normalized_records(output_path) == _reference(engine, tmp_path, lines)


# -- one writer per output ------------------------------------------------------------------


def test_a_second_job_on_the_same_output_is_refused_at_once_naming_the_first(tmp_path, capsys):
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(input_path, [_line(0)])
    with JobLock(str(output_path)):  # a running job
        code, _, err = _run_cli(capsys, input_path, "-o", output_path, "--model", MISSING_MODEL)
    assert code == 2 and f"(pid {os.getpid()}, started " in err and "wait for it to finish" in err, err
    assert "loading model" not in err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]  # touched nothing; the lock is gone with its job


def test_the_lock_of_a_killed_job_is_taken_over(tmp_path, capsys):
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(input_path, [_line(0)])
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from batchllm.io.job_files import JobLock; "
                               "JobLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(600)",
         str(output_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, _, err = _run_cli(capsys, input_path, "-o", output_path, "--model", MODEL, "--kv-cache-tokens", KV_TOKENS)
        assert code == 2 and f"pid {holder.pid}" in err
    finally:
        holder.kill()
        holder.wait(timeout=60)
    assert (tmp_path / "out.jsonl.lock").exists()  # left behind by the killed job
    code, out, err = _run_cli(capsys, input_path, "-o", output_path, "--model", MODEL, "--kv-cache-tokens", KV_TOKENS)
    assert code == 0 and "1 requests answered" in out, err
    assert not (tmp_path / "out.jsonl.lock").exists()


# -- refusals before any work ---------------------------------------------------------------


def test_an_output_that_is_the_input_is_refused_however_it_is_named(tmp_path, capsys):
    input_path = tmp_path / "in.jsonl"
    _write(input_path, [_line(0)])
    original = input_path.read_bytes()
    os.symlink(input_path, tmp_path / "link.jsonl")
    os.link(input_path, tmp_path / "hard.jsonl")
    for output in (input_path, tmp_path / "link.jsonl", tmp_path / "hard.jsonl", tmp_path / "." / "in.jsonl"):
        for flags in ((), ("--overwrite",)):
            code, _, err = _run_cli(capsys, input_path, "-o", output, "--model", MISSING_MODEL, *flags)
            assert code == 2 and "is the input file (fix: choose another -o path)" in err, err
    code, _, err = _run_cli(capsys, input_path, "-o", tmp_path / "out.jsonl", "--errors", tmp_path / "link.jsonl",
                            "--model", MISSING_MODEL)
    assert code == 2 and "--errors" in err and "is the input file" in err
    assert input_path.read_bytes() == original
    assert sorted(os.listdir(tmp_path)) == ["hard.jsonl", "in.jsonl", "link.jsonl"]


@pytest.mark.parametrize("which", ["-o", "--errors"])
def test_a_directory_or_unwritable_path_is_refused_naming_the_right_flag(tmp_path, capsys, which):
    input_path = tmp_path / "in.jsonl"
    _write(input_path, [_line(0)])
    not_a_dir = tmp_path / "file.txt"
    not_a_dir.write_text("x")
    for bad, message in ((tmp_path, "is a directory (fix: name a file"),
                         (not_a_dir / "out.jsonl", f"(fix: choose a writable {which} path)")):
        paths = {"-o": tmp_path / "out.jsonl", "--errors": tmp_path / "errors.jsonl", which: bad}
        code, _, err = _run_cli(capsys, input_path, "-o", paths["-o"], "--errors", paths["--errors"],
                                "--model", MISSING_MODEL)
        error_line = next(line for line in err.splitlines() if line.startswith("error:"))
        assert code == 2 and message in error_line and f"{which} " in error_line, err
        assert ("-o " in error_line) == (which == "-o")  # --errors problems do not blame -o
    assert sorted(os.listdir(tmp_path)) == ["file.txt", "in.jsonl"]  # no journal stranded beside a bad path


def test_an_existing_output_or_symlink_needs_overwrite(tmp_path, capsys):
    input_path = tmp_path / "in.jsonl"
    _write(input_path, [_line(0)])
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    (tmp_path / "out.jsonl").write_text("old results")
    os.symlink(target, tmp_path / "link.jsonl")
    for output, kind in (("out.jsonl", "a file"), ("link.jsonl", "a symlink")):
        code, _, err = _run_cli(capsys, input_path, "-o", tmp_path / output, "--model", MISSING_MODEL)
        assert code == 2 and f"already exists ({kind}) (fix: add --overwrite" in err, err
    assert (tmp_path / "out.jsonl").read_text() == "old results" and target.read_text() == "keep me"
    code, out, err = _run_cli(capsys, input_path, "-o", tmp_path / "link.jsonl", "--model", MODEL, "--overwrite", "--kv-cache-tokens", KV_TOKENS)
    assert code == 0 and target.read_text() == "keep me" and not os.path.islink(tmp_path / "link.jsonl"), err
    assert [r["custom_id"] for r in normalized_records(tmp_path / "link.jsonl")] == ["r00"]


def test_a_resume_may_replace_the_output_its_own_job_wrote(engine, tmp_path, capsys):
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(input_path, [_line(i) for i in range(4)])
    _interrupted(engine, input_path, output_path, 2)
    output_path.write_text("renamed into place before a kill removed the journal")
    code, out, err = _run_cli(capsys, input_path, "-o", output_path, "--model", MODEL, "--kv-cache-tokens", KV_TOKENS)
    assert code == 0 and "4 requests answered" in out, err


def test_kv_cache_smaller_than_one_block_is_refused(capsys, tmp_path):
    input_path = tmp_path / "in.jsonl"
    _write(input_path, [_line(0)])
    code, _, err = _run_cli(capsys, input_path, "-o", tmp_path / "out.jsonl", "--model", MISSING_MODEL,
                            "--kv-cache-tokens", "8")
    assert code == 2 and "--kv-cache-tokens 8 is less than one KV block (--block-size 16): give at least 16" in err
    with pytest.raises(ValueError, match=r"--kv-cache-tokens 8 is less than one KV block \(--block-size 16\)"):
        engine_config(MODEL, kv_cache_tokens=8)


# -- bounded memory -------------------------------------------------------------------------


def test_a_line_over_max_line_bytes_is_an_error_record_read_in_bounded_chunks(tmp_path, capsys):
    input_path = tmp_path / "in.jsonl"
    huge = json.dumps(_line(1, prompt_token_ids=[5] * 400_000)).encode()  # 1.2 MB
    _write(input_path, [_line(0), huge, _line(2)])
    lines = list(read_lines(str(input_path), max_line_bytes=100_000))
    assert [line.data is None for line in lines] == [False, True, False]
    assert lines[1].digest == digest64(huge + b"\n") and lines[1].num_bytes == len(huge) + 1
    code, out, err = _run_cli(capsys, input_path, "-o", tmp_path / "out.jsonl", "--model", MODEL,
                              "--max-line-bytes", "100000")
    assert code == 0, err
    records = normalized_records(tmp_path / "out.jsonl")
    assert records[1]["error"]["code"] == "line_too_long" and records[1]["error"]["line"] == 2
    assert "over the limit of 100000" in records[1]["error"]["message"] and "--max-line-bytes" in records[1]["error"][
        "message"]
    assert [r["error"] is None for r in records] == [True, False, True]


class _CountingTokenizer:
    """A stand-in HF tokenizer: one token per 3 characters; records the text lengths it saw."""

    def __init__(self):
        self.seen_num_chars = []

    def __call__(self, text, add_special_tokens=True):
        self.seen_num_chars.append(len(text))
        return type("Encoding", (), {"input_ids": list(range(len(text) // 3))})()


def test_tokenizing_stops_soon_after_the_context_length():
    from batchllm.models.tokenizer import CAP_MARGIN_TOKENS, Tokenizer

    hf = _CountingTokenizer()
    tokenizer = Tokenizer(hf)
    ids = tokenizer.encode_prompt("x" * 30_000_000, max_num_tokens=1000)
    assert len(ids) > 1000 + CAP_MARGIN_TOKENS
    assert max(hf.seen_num_chars) <= 16 * (1000 + CAP_MARGIN_TOKENS)  # not 30 MB
    hf.seen_num_chars.clear()
    assert len(tokenizer.encode_prompt("x" * 3000, max_num_tokens=1000)) == 1000  # short: exact, one call
    assert hf.seen_num_chars == [3000]
    assert len(tokenizer.encode_prompt("x" * 3000)) == 1000


# -- no valid line crashes the job ----------------------------------------------------------

FIELDS = ["max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
          "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "n", "logit_bias",
          "include_stop_str_in_output", "tools", "tool_choice", "functions", "response_format", "model", "user",
          "stream", "presence_penalty"]
JSON_VALUES = [None, True, False, 0, 1, -1, 7, 2**70, 0.5, -0.5, 1e308, "x", "", [], [1], ["a"], [True],
               {}, {"type": "text"}, {"a": 1}]
PROPER_CODES = {"invalid_sampling", "unsupported_feature", "invalid_request"}


def test_every_sampling_field_with_every_json_type_gives_an_answer_or_a_proper_error(tmp_path, capsys):
    lines = []
    for url in ("/v1/completions", "/v1/chat/completions"):
        for name in FIELDS:
            for value in JSON_VALUES:
                body = {"prompt_token_ids": [5, 6, 7], "max_tokens": 2, name: value}
                lines.append({"custom_id": f"{len(lines)}", "method": "POST", "url": url, "body": body})
    input_path = tmp_path / "in.jsonl"
    _write(input_path, lines)
    code, out, err = _run_cli(capsys, input_path, "-o", tmp_path / "out.jsonl", "--model", MODEL,
                              "--kv-cache-tokens", KV_TOKENS, "--window", "200")
    assert code == 0, err
    records = normalized_records(tmp_path / "out.jsonl")
    assert [r["custom_id"] for r in records] == [line["custom_id"] for line in lines]
    for line, record in zip(lines, records):
        if record["error"] is None:
            assert record["response"]["status_code"] == 200
        else:
            assert record["error"]["code"] in PROPER_CODES, (line, record["error"])
    by_id = {r["custom_id"]: r for r in records}

    def outcome(url, name, value):
        line = next(x for x in lines if x["url"] == url and name in x["body"] and x["body"][name] == value
                    and type(x["body"][name]) is type(value))
        record = by_id[line["custom_id"]]
        return record["error"]["code"] if record["error"] else "ok"

    completions, chat = "/v1/completions", "/v1/chat/completions"
    assert outcome(completions, "logprobs", True) == "invalid_sampling"
    assert outcome(completions, "logprobs", 1) == "ok"
    assert outcome(chat, "logprobs", True) == "ok" and outcome(chat, "logprobs", 1) == "invalid_sampling"
    assert outcome(chat, "top_logprobs", True) == "invalid_sampling"
    assert outcome(chat, "top_logprobs", 1) == "invalid_sampling"  # needs logprobs: true
    assert outcome(completions, "seed", 2**70) == "invalid_sampling"
    assert outcome(completions, "ignore_eos", "x") == "invalid_sampling"
    assert outcome(completions, "n", True) == "invalid_sampling"
    for name in ("tools", "functions"):
        assert outcome(chat, name, {"a": 1}) == "unsupported_feature"
        assert outcome(chat, name, None) == "ok"
    assert outcome(chat, "response_format", {"a": 1}) == "invalid_request"  # a structured output needs a type
    assert outcome(chat, "response_format", None) == "ok"
    assert outcome(chat, "response_format", {"type": "text"}) == "ok"
    assert outcome(chat, "tool_choice", "x") == "unsupported_feature"
    message = by_id[next(x["custom_id"] for x in lines if x["body"].get("tools") == [1])]["error"]["message"]
    assert "tools" in message


@pytest.mark.default_model
def test_logprobs_true_on_completions_and_top_logprobs_true_on_chat_do_not_crash_the_default_model(
        tmp_path, capsys, cli_default_engine):
    lines = [{"custom_id": "c", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "Hi", "max_tokens": 2, "logprobs": True}},
             {"custom_id": "t", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True,
                       "top_logprobs": True}},
             {"custom_id": "ok", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True,
                       "top_logprobs": 2}}]
    input_path = tmp_path / "in.jsonl"
    _write(input_path, lines)
    code, out, err = _run_cli(capsys, input_path, "-o", tmp_path / "out.jsonl", "--kv-cache-tokens", "2048")
    assert code == 0 and len(cli_default_engine) == 1, err  # the default model ran
    records = normalized_records(tmp_path / "out.jsonl")
    assert [(r["error"] or {}).get("code") for r in records] == ["invalid_sampling", "invalid_sampling", None]
    assert records[2]["response"]["body"]["choices"][0]["logprobs"] is not None


class _FailingEngine:
    """The real engine, except that a batch holding request `poison` raises (a bug in serving it)."""

    def __init__(self, engine, poison):
        self._engine, self.poison = engine, poison

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def run(self, requests, **kwargs):
        if any(r.request_id == self.poison for r in requests):
            raise RuntimeError("boom in the sampler")
        yield from self._engine.run(requests, **kwargs)


def test_a_request_that_fails_while_being_served_gets_internal_error_and_the_job_goes_on(engine, tmp_path):
    lines = [_line(i) for i in range(7)]
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(input_path, lines)
    summary = run_batch_file(_FailingEngine(engine, poison=4), str(input_path), str(output_path),
                             options=BatchJobOptions(show_progress=False))
    assert (summary.num_requests, summary.num_errors) == (6, 1)
    records, reference = normalized_records(output_path), _reference(engine, tmp_path, lines)
    assert records[3]["error"] == {"code": "internal_error", "message": "RuntimeError: boom in the sampler", "line": 4}
    assert records[:3] + records[4:] == reference[:3] + reference[4:]


class _BreakingEngine(_FailingEngine):
    """The real engine until it has answered `num_answers` requests; then it can run nothing."""

    def __init__(self, engine, num_answers):
        super().__init__(engine, poison=None)
        self.num_answers = num_answers

    def run(self, requests, **kwargs):
        from batchllm.engine.errors import EngineBrokenError

        for done in self._engine.run(requests, **kwargs):
            if self.num_answers == 0:
                raise EngineBrokenError("a step failed mid-way")
            self.num_answers -= 1
            yield done


def test_an_engine_that_breaks_stops_the_job_instead_of_failing_every_request(engine, tmp_path):
    lines = [_line(i) for i in range(7)]
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(input_path, lines)
    from batchllm.engine.errors import EngineBrokenError

    with pytest.raises(EngineBrokenError):
        run_batch_file(_BreakingEngine(engine, num_answers=3), str(input_path), str(output_path),
                       options=BatchJobOptions(show_progress=False))
    assert not output_path.exists()  # no output with errors for the requests never run
    summary = run_batch_file(engine, str(input_path), str(output_path), options=BatchJobOptions(show_progress=False))
    assert (summary.num_requests, summary.num_errors) == (7, 0)  # the next run resumes and answers all
    assert normalized_records(output_path) == _reference(engine, tmp_path, lines)


# -- smaller faults -------------------------------------------------------------------------


@pytest.mark.default_model
def test_a_bom_does_not_make_line_1_invalid_and_the_body_names_the_model_that_ran(tmp_path, capsys):
    input_path = tmp_path / "in.jsonl"
    _write(input_path, [b"\xef\xbb\xbf" + json.dumps(_line(0, model="gpt-4o-mini")).encode(), _line(1)])
    code, out, err = _run_cli(capsys, input_path, "-o", tmp_path / "out.jsonl", "--model", MODEL, "--kv-cache-tokens", KV_TOKENS)
    assert code == 0 and "2 requests answered, 0 errors" in out, err
    assert [r["response"]["body"]["model"] for r in normalized_records(tmp_path / "out.jsonl")] == [MODEL, MODEL]


@pytest.mark.parametrize("content", [b"", b"\n\n", b"{broken\n[1]\n"])
def test_an_input_with_nothing_to_run_never_loads_the_model(tmp_path, capsys, content):
    input_path = tmp_path / "in.jsonl"
    input_path.write_bytes(content)
    code, out, err = _run_cli(capsys, input_path, "-o", tmp_path / "out.jsonl", "--model", MISSING_MODEL)
    assert code == 0 and "has no line that can run" in err and "loading model" not in err, err
    records = normalized_records(tmp_path / "out.jsonl")
    expected = ["invalid_json", "invalid_request"] if b"broken" in content else []
    assert [r["error"]["code"] for r in records] == expected


_SIGNAL_SCRIPT = textwrap.dedent("""
    import sys, time
    from batchllm.job.batch_job import StopRequest
    from batchllm.job.stop_signals import StopSignals
    stop = StopRequest()
    stop.on_exit_now = lambda: print("flushed", flush=True)
    with StopSignals(stop):
        print("ready", flush=True)
        time.sleep(300)  # a step that takes minutes
""")


@pytest.mark.parametrize("signals, exit_code", [((signal.SIGINT, signal.SIGINT), 130),
                                                ((signal.SIGTERM, signal.SIGTERM), 143),
                                                ((signal.SIGINT, signal.SIGTERM), 143)])
def test_a_second_signal_exits_at_once_with_its_own_code(signals, exit_code):
    process = subprocess.Popen([sys.executable, "-c", _SIGNAL_SCRIPT], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        started = time.monotonic()
        for signum in signals:  # while the main thread is busy: they must not merge into one
            process.send_signal(signum)
            time.sleep(0.5)  # the kernel itself merges a signal sent while the same one is pending
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == exit_code, err
    assert time.monotonic() - started < 100  # not the 300 s "step"
    assert "flushed" in out and "stopping now" in err
