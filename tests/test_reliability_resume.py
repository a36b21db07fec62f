"""A job killed with SIGKILL (plus a torn journal line) or stopped with SIGTERM is finished by
running the same command again; the final file equals an uninterrupted run (greedy): no
duplicates, none missing. random:tiny with long generations keeps the job running for seconds
(so it is killed mid-run) without the default model's load time; the timeouts leave room for a
loaded machine."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from batchllm.cli.main import main
from model_helpers import normalized_records

NUM_REQUESTS = 10
TIMEOUT_S = 600


def _argv(input_path, output_path):
    return ["run", str(input_path), "-o", str(output_path), "--no-progress", "--window", "1", "--model",
            "random:tiny", "--kv-cache-tokens", "4096"]


def _command(input_path, output_path):
    """The job as a process of its own, to be killed."""
    return [sys.executable, "-m", "batchllm.cli.main", *_argv(input_path, output_path)]


def _run_in_process(capsys, input_path, output_path):
    """The same command run again, here (a resume needs no process of its own): (exit code, stdout, stderr)."""
    code = main(_argv(input_path, output_path))
    out, err = capsys.readouterr()
    return code, out, err




@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The input file and the output of an uninterrupted run."""
    root = tmp_path_factory.mktemp("resume")
    input_path = root / "in.jsonl"
    lines = [{"custom_id": f"q{i}", "prompt_token_ids": [5 + i, 9, 17 + 3 * i], "max_tokens": 16 + 2 * i,
              "temperature": 0, "ignore_eos": True} for i in range(NUM_REQUESTS)]
    lines.insert(3, "{broken json")
    # n samples, unseeded: each sample's seed derives from the engine's seed and the line, so a
    # line run again after a crash gives the same answer
    lines.append({"custom_id": "samples", "prompt_token_ids": [6, 9, 17, 4], "max_tokens": 24, "n": 3,
                  "temperature": 1.0, "ignore_eos": True})
    input_path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    reference = root / "reference.jsonl"
    assert main(_argv(input_path, reference)) == 0
    records = normalized_records(reference)
    assert len({tuple(c["token_ids"]) for c in records[-1]["response"]["body"]["choices"]}) == 3
    return input_path, records


def _num_records(partial_path):
    """Record lines of a journal (its header and engine line start with #)."""
    with open(partial_path, "rb") as handle:
        return sum(1 for line in handle if not line.startswith(b"#"))


def _start_and_wait_for_records(command, partial_path, num_records):
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        if os.path.exists(partial_path):
            if _num_records(partial_path) >= num_records:
                return process
        time.sleep(0.02)
    process.kill()
    pytest.fail(f"the job ended or stalled before journaling {num_records} records: {process.communicate()}")


def test_sigkill_then_resume_equals_an_uninterrupted_run(job, tmp_path, capsys):
    input_path, reference = job
    output_path = tmp_path / "out.jsonl"
    partial_path = str(output_path) + ".partial"
    process = _start_and_wait_for_records(_command(input_path, output_path), partial_path, 2)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert process.returncode == -signal.SIGKILL and not output_path.exists()
    journaled = _num_records(partial_path)
    assert 2 <= journaled < len(reference)
    with open(partial_path, "ab") as handle:  # as if killed in the middle of a write
        handle.write(b'9\t00000000000000ab\t{"custom_id": "q7", "response": {"sta')
    code, out, err = _run_in_process(capsys, input_path, output_path)
    assert code == 0, err
    assert f"resuming from {partial_path}: {journaled} records kept, a torn last line (56 bytes) dropped" in err
    assert f"({journaled} resumed from an earlier run)" in out
    assert normalized_records(output_path) == reference
    assert not os.path.exists(partial_path)


def test_sigterm_saves_what_is_done_exits_143_and_resumes(job, tmp_path, capsys):
    input_path, reference = job
    output_path = tmp_path / "out.jsonl"
    partial_path = str(output_path) + ".partial"
    process = _start_and_wait_for_records(_command(input_path, output_path), partial_path, 2)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=TIMEOUT_S)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert "interrupted by SIGTERM" in stderr and "Run the same command again to resume" in stderr
    assert not output_path.exists() and os.path.exists(partial_path)
    code, _, err = _run_in_process(capsys, input_path, output_path)
    assert code == 0, err
    assert normalized_records(output_path) == reference
