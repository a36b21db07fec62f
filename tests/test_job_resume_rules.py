"""What a resume may keep: duplicate custom_ids are decided again from the current input, and
everything that determines an answer (model files, dtype, the token limit that clamps
max_tokens, --max-line-bytes) is in the journal, so a resume never mixes answers of two setups
(random:tiny, token-id prompts)."""

import json
import os

import pytest

from batchllm.cli.main import main
from batchllm.config import EngineConfig, engine_config
from batchllm.engine.llm_engine import LLMEngine
from batchllm.io.journal import JournalMismatchError
from batchllm.job.batch_job import BatchJobOptions, LazyEngine, StopRequest, run_batch_file
from batchllm.job.job_identity import job_header, model_fingerprint
from model_helpers import normalized_records

MODEL = "random:tiny"
KV_TOKENS = 256


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(engine_config(MODEL, kv_cache_tokens=KV_TOKENS))


def _line(custom_id, i, **fields):
    return {"custom_id": custom_id, "prompt_token_ids": [3 + i, 7 + 2 * i, 11 + 3 * i], "max_tokens": 3,
            "temperature": 0, "ignore_eos": True, **fields}


def _write(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))


def _num_records(journal_path):
    with open(journal_path, "rb") as handle:
        return sum(1 for line in handle if not line.startswith(b"#"))


class _StopAfterRecords(StopRequest):
    """Asks the job to stop (as SIGTERM does) once its journal holds num_records records."""

    def __init__(self, journal_path, num_records):
        super().__init__()
        self.journal_path, self.num_records = journal_path, num_records

    @property
    def requested(self):
        if self.signal_name is None and os.path.exists(self.journal_path) \
                and _num_records(self.journal_path) >= self.num_records:
            self.signal_name, self.exit_code = "SIGTERM", 143
        return self.signal_name is not None


def _options(**changes):
    return BatchJobOptions(show_progress=False, window_num_requests=1, **changes)


def _run(engine, input_path, output_path, stop_after=None):
    stop = _StopAfterRecords(str(output_path) + ".partial", stop_after) if stop_after else None
    summary = run_batch_file(engine, str(input_path), str(output_path), options=_options(), stop=stop)
    assert (summary.interrupted_by is not None) == (stop_after is not None)
    return summary


def _reference(engine, tmp_path, lines):
    path = tmp_path / "reference.in.jsonl"
    _write(path, lines)
    _run(engine, path, tmp_path / "reference.jsonl")
    return normalized_records(tmp_path / "reference.jsonl")


def _ids_and_codes(records):
    return [(r["custom_id"], (r["error"] or {}).get("code")) for r in records]


# -- duplicate custom_ids -------------------------------------------------------------------


def test_an_invalid_line_holds_its_custom_id_against_a_later_valid_line(engine, tmp_path):
    input_path = tmp_path / "in.jsonl"
    _write(input_path, [_line("a", 0, temperature=-1), _line("a", 1), _line("b", 2)])
    _run(engine, input_path, tmp_path / "out.jsonl")
    assert _ids_and_codes(normalized_records(tmp_path / "out.jsonl")) == [
        ("a", "invalid_sampling"), ("a", "duplicate_custom_id"), ("b", None)]


def test_a_journaled_duplicate_is_answered_once_an_edit_makes_it_unique(engine, tmp_path):
    lines = [_line("r0", 0), _line("r1", 1), _line("r1", 2), _line("r3", 3), _line("r4", 4)]
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(input_path, lines)
    _run(engine, input_path, output_path, stop_after=3)  # line 3's duplicate record is journaled
    assert b"duplicate_custom_id" in (tmp_path / "out.jsonl.partial").read_bytes()
    edited = [lines[0], _line("r9", 1), *lines[2:]]  # line 2 now holds another id: line 3 is unique
    _write(input_path, edited)
    _run(engine, input_path, output_path)
    records = normalized_records(output_path)
    assert _ids_and_codes(records) == [("r0", None), ("r9", None), ("r1", None), ("r3", None), ("r4", None)]
    assert records == _reference(engine, tmp_path, edited)


def test_an_answered_line_that_an_edit_makes_a_duplicate_loses_its_answer(engine, tmp_path):
    lines = [_line(f"r{i}", i) for i in range(5)]
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(input_path, lines)
    _run(engine, input_path, output_path, stop_after=4)  # r0..r3 answered
    edited = [_line("r3", 0), *lines[1:]]  # line 1 takes r3: the answered line 4 is now a duplicate
    _write(input_path, edited)
    _run(engine, input_path, output_path)
    records = normalized_records(output_path)
    assert _ids_and_codes(records) == [("r3", None), ("r1", None), ("r2", None), ("r3", "duplicate_custom_id"),
                                       ("r4", None)]
    assert records == _reference(engine, tmp_path, edited)


# -- what determines an answer is in the journal --------------------------------------------


def _cli(capsys, input_path, output_path, *flags):
    code = main(["run", str(input_path), "-o", str(output_path), "--model", MODEL, "--window", "1",
                 "--no-progress", *map(str, flags)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_resume_never_mixes_max_tokens_clamped_by_two_kv_cache_sizes(tmp_path, capsys):
    lines = [_line(f"r{i}", i, max_tokens=1000) for i in range(3)]  # clamped to the token limit
    lines.insert(1, _line("long", 9, prompt_token_ids=[5] * 310))  # over the limit
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(input_path, lines)
    assert _cli(capsys, input_path, tmp_path / "reference.jsonl", "--kv-cache-tokens", 320)[0] == 0
    reference = normalized_records(tmp_path / "reference.jsonl")
    assert [r["response"]["body"]["usage"]["completion_tokens"] for r in reference if r["response"]] == [301] * 3
    assert "the limit is 303 (max model length 2048, KV cache 320 tokens)" in reference[1]["error"]["message"]
    _run(LLMEngine(engine_config(MODEL, kv_cache_tokens=320)), input_path, output_path, stop_after=1)
    journal = tmp_path / "out.jsonl.partial"
    before = journal.read_bytes()
    code, _, err = _cli(capsys, input_path, output_path, "--kv-cache-tokens", 256)
    assert code == 2 and "up to 304 tokens a request" in err and "this run allows 240" in err, err
    assert "--kv-cache-tokens 320" in err and "--restart" in err
    assert journal.read_bytes() == before and not output_path.exists()
    code, out, err = _cli(capsys, input_path, output_path, "--kv-cache-tokens", 512)  # larger: held to 304
    assert code == 0 and "(1 resumed from an earlier run)" in out, err
    assert "this engine allows 496, and the job keeps 304" in err
    assert normalized_records(output_path) == reference  # the error message too


def test_a_larger_max_line_bytes_on_resume_is_refused_by_name(tmp_path, capsys):
    long_line = _line("long", 1, user="x" * 200)
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(input_path, [long_line, _line("r1", 1), _line("r2", 2)])
    engine = LLMEngine(engine_config(MODEL, kv_cache_tokens=KV_TOKENS))
    stop = _StopAfterRecords(str(output_path) + ".partial", 2)
    run_batch_file(engine, str(input_path), str(output_path), options=_options(max_line_bytes=200), stop=stop)
    code, _, err = _cli(capsys, input_path, output_path, "--kv-cache-tokens", KV_TOKENS, "--max-line-bytes", 10000)
    assert code == 2 and "--max-line-bytes 200 -> 10000" in err and "--restart" in err, err
    code, _, err = _cli(capsys, input_path, output_path, "--kv-cache-tokens", KV_TOKENS, "--max-line-bytes", 200)
    assert code == 0, err
    assert [(r["error"] or {}).get("code") for r in normalized_records(output_path)] == ["line_too_long", None, None]


def test_a_model_directory_replaced_under_the_same_path_is_refused(engine, tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    (model_dir / "model.safetensors").write_bytes(b"old weights")
    lazy = LazyEngine(engine_config(str(model_dir), kv_cache_tokens=KV_TOKENS), lambda: engine)
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(input_path, [_line(f"r{i}", i) for i in range(4)])
    stop = _StopAfterRecords(str(output_path) + ".partial", 2)
    run_batch_file(lazy, str(input_path), str(output_path), options=_options(), stop=stop)
    (model_dir / "model.safetensors").write_bytes(b"new weights")  # same size, new contents and mtime
    os.utime(model_dir / "model.safetensors", ns=(1, 1))
    with pytest.raises(JournalMismatchError, match=r"--model \(its files\) '[0-9a-f]{16}' -> '[0-9a-f]{16}'"):
        run_batch_file(lazy, str(input_path), str(output_path), options=_options())


def test_model_fingerprint_follows_names_sizes_and_mtimes(tmp_path):
    model_dir = tmp_path / "model"
    (model_dir / ".cache").mkdir(parents=True)
    (model_dir / "config.json").write_text("{}")
    first = model_fingerprint(str(model_dir))
    (model_dir / ".cache" / "download.lock").write_text("")  # hidden: not part of the model
    assert model_fingerprint(str(model_dir)) == first
    (model_dir / "tokenizer.json").write_text("{}")
    second = model_fingerprint(str(model_dir))
    assert second != first
    os.utime(model_dir / "tokenizer.json", ns=(5, 5))
    assert model_fingerprint(str(model_dir)) not in (first, second)
    assert model_fingerprint("random:tiny") == model_fingerprint("random:tiny?seed=0")
    assert model_fingerprint("random:tiny") != model_fingerprint("random:tiny?num_layers=1")
    assert model_fingerprint(str(tmp_path / "missing")) is None


def test_the_header_records_the_resolved_dtype_and_device():
    header = job_header(EngineConfig(model=MODEL), max_line_bytes=100).job
    assert (header["dtype"], header["device"], header["max_line_bytes"]) == ("float32", "cpu", 100)


def test_a_model_that_could_not_load_may_be_fixed_on_resume(engine, tmp_path):
    lines = ["{broken", _line("r1", 1), _line("r2", 2)]
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(input_path, lines)

    def fail():
        raise FileNotFoundError("no such model")

    missing = LazyEngine(engine_config(str(tmp_path / "missing.gguf"), kv_cache_tokens=KV_TOKENS), fail)
    with pytest.raises(FileNotFoundError):
        run_batch_file(missing, str(input_path), str(output_path), options=_options())
    assert _num_records(tmp_path / "out.jsonl.partial") == 1  # line 1's error, made without an engine
    summary = run_batch_file(engine, str(input_path), str(output_path), options=_options())
    assert summary.num_resumed == 1
    assert normalized_records(output_path) == _reference(engine, tmp_path, lines)
    stop = _StopAfterRecords(str(tmp_path / "again.jsonl.partial"), 2)  # once an engine ran, the model is fixed
    run_batch_file(engine, str(input_path), str(tmp_path / "again.jsonl"), options=_options(), stop=stop)
    with pytest.raises(JournalMismatchError, match="--model 'random:tiny' -> "):
        run_batch_file(missing, str(input_path), str(tmp_path / "again.jsonl"), options=_options())
