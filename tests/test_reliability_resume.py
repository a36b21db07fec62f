"""A job killed with SIGKILL (plus a torn journal line) or stopped with SIGTERM is
finished by running the same command again; the final file equals an uninterrupted run
(greedy, default model): no duplicates, none missing."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest_plugins = ["model_fixtures"]

TOPICS = ["Cats", "Dogs", "Oceans", "Robots", "Winter", "Cities", "Music", "Trees", "Rivers", "Stars"]
WINDOW = 5
KV_CACHE_TOKENS = 4096  # the shared default engine's (model_fixtures.DEFAULT_KV_CACHE_TOKENS)


def _command(input_path, output_path):
    return [sys.executable, "-m", "batchllm.cli.main", "run", str(input_path), "-o", str(output_path),
            "--no-progress", "--window", str(WINDOW), "--kv-cache-tokens", str(KV_CACHE_TOKENS)]


def _normalized(path):
    """Records without what legitimately differs between runs: random ids, timestamps, and
    cached-token counts (prefix reuse depends on which requests ran together)."""
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


@pytest.fixture(scope="module")
def job(tmp_path_factory, session_default_llm):
    """The input file and the output of an uninterrupted run: the same job as `_command` runs,
    in this process on the session's engine of the same configuration (a subprocess would load
    the model once more)."""
    from batchllm.batch_job import BatchJobOptions, run_batch_file

    root = tmp_path_factory.mktemp("resume")
    input_path = root / "in.jsonl"
    lines = [{"custom_id": f"q{i}", "prompt": f"{topic} are interesting. Tell me why.", "max_tokens": 12 + 2 * i,
              "temperature": 0, "ignore_eos": True} for i, topic in enumerate(TOPICS)]
    lines.insert(3, "{broken json")
    input_path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    reference = root / "reference.jsonl"
    engine = session_default_llm.engine
    assert engine.num_kv_tokens == KV_CACHE_TOKENS
    run_batch_file(engine, str(input_path), str(reference),
                   options=BatchJobOptions(window_num_requests=WINDOW, show_progress=False))
    return input_path, _normalized(reference)


def _start_and_wait_for_records(command, partial_path, num_records):
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600  # model load and the first records, on a loaded machine
    while time.monotonic() < deadline and process.poll() is None:
        if os.path.exists(partial_path):
            with open(partial_path, "rb") as handle:
                if handle.read().count(b"\n") >= 1 + num_records:  # header + records
                    return process
        time.sleep(0.02)
    process.kill()
    pytest.fail(f"the job ended or stalled before journaling {num_records} records: {process.communicate()}")


def test_sigkill_then_resume_equals_an_uninterrupted_run(job, tmp_path):
    input_path, reference = job
    output_path = tmp_path / "out.jsonl"
    partial_path = str(output_path) + ".partial"
    process = _start_and_wait_for_records(_command(input_path, output_path), partial_path, 2)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert process.returncode == -signal.SIGKILL and not output_path.exists()
    journaled = open(partial_path, "rb").read().count(b"\n") - 1
    assert 2 <= journaled < len(reference)
    with open(partial_path, "ab") as handle:  # as if killed in the middle of a write
        handle.write(b'9\t{"custom_id": "q7", "response": {"sta')
    result = subprocess.run(_command(input_path, output_path), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    assert f"resuming from {partial_path}: {journaled} records kept, a torn last line (39 bytes) dropped" in result.stderr
    assert f"({journaled} resumed from an earlier run)" in result.stdout
    assert _normalized(output_path) == reference
    assert not os.path.exists(partial_path)


def test_sigterm_saves_what_is_done_exits_143_and_resumes(job, tmp_path):
    input_path, reference = job
    output_path = tmp_path / "out.jsonl"
    partial_path = str(output_path) + ".partial"
    process = _start_and_wait_for_records(_command(input_path, output_path), partial_path, 2)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert "interrupted by SIGTERM" in stderr and "Run the same command again to resume" in stderr
    assert not output_path.exists() and os.path.exists(partial_path)
    result = subprocess.run(_command(input_path, output_path), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    assert _normalized(output_path) == reference
