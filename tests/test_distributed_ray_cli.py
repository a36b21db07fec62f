"""`batchllm run --ray` as a process: killed (SIGKILL) or stopped (SIGTERM) mid-run, the same
command resumes it and the file equals an uninterrupted run; --tensor-parallel-size is refused.
The jobs join the session's Ray cluster (RAY_ADDRESS) rather than start one each."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from model_helpers import normalized_records

pytest_plugins = ["ray_fixtures"]

TIMEOUT_S = 600
LONG_MAX_TOKENS = 1000
# 4 short requests finish after a few steps; the long ones keep each replica busy for seconds.
LINES = [{"custom_id": f"q{i}", "prompt_token_ids": [5 + i, 9, 17 + 3 * i, 40 + i],
          "max_tokens": LONG_MAX_TOKENS if i % 2 else 3, "temperature": 0, "ignore_eos": True}
         for i in range(8)]


def _command(input_path, output_path, *extra):
    return [sys.executable, "-m", "batchllm.cli.main", "run", str(input_path), "-o", str(output_path),
            "--no-progress", "--model", "random:tiny", "--device", "cpu", "--kv-cache-tokens", "8192", *extra]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The input file and the records of an uninterrupted run without Ray."""
    root = tmp_path_factory.mktemp("ray_cli")
    input_path = root / "in.jsonl"
    input_path.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    reference = root / "reference.jsonl"
    result = subprocess.run(_command(input_path, reference), capture_output=True, text=True,
                            timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    return input_path, normalized_records(reference)


def _ray_job(ray_address, input_path, output_path, **kwargs):
    env = dict(os.environ, RAY_ADDRESS=ray_address)
    return subprocess.Popen(_command(input_path, output_path, "--ray", "--num-replicas", "2"), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def _num_records(partial_path) -> int:
    """Record lines of a journal (its header and engine line start with #)."""
    with open(partial_path, "rb") as handle:
        return sum(1 for line in handle if line.endswith(b"\n") and not line.startswith(b"#"))


def _wait_for_records(process, partial_path, num_records) -> int:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        if os.path.exists(partial_path):
            num_journaled = _num_records(partial_path)
            if num_journaled >= num_records:
                return num_journaled
        time.sleep(0.05)
    process.kill()
    pytest.fail(f"the job ended or stalled before journaling {num_records} records: {process.communicate()}")


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_ray_job_killed_mid_run_resumes_to_the_uninterrupted_file(ray_address, job, tmp_path, signum):
    """The short requests reach the journal while the long ones run (streaming); killed then, the
    same command finishes the job. SIGTERM: the job stops at once, saves and exits 143."""
    input_path, reference = job
    output_path = tmp_path / "out.jsonl"
    partial_path = str(output_path) + ".partial"
    process = _ray_job(ray_address, input_path, output_path)
    journaled = _wait_for_records(process, partial_path, 2)
    process.send_signal(signum)
    started = time.monotonic()
    _, stderr = process.communicate(timeout=TIMEOUT_S)
    stop_s = time.monotonic() - started
    if signum == signal.SIGTERM:
        assert process.returncode == 143, stderr
        assert "interrupted by SIGTERM" in stderr and stop_s < 60, (stop_s, stderr)
    else:
        assert process.returncode == -signal.SIGKILL
    kept = _num_records(partial_path)
    assert 2 <= journaled <= kept < len(LINES) and not output_path.exists()
    resumed = _ray_job(ray_address, input_path, output_path)
    stdout, stderr = resumed.communicate(timeout=TIMEOUT_S)
    assert resumed.returncode == 0, stderr
    assert f"resuming from {partial_path}: {kept} records kept" in stderr
    assert f"({kept} resumed from an earlier run)" in stdout
    num_steps = int(stdout.split(" generated tokens/s (")[1].split(" steps)")[0])
    assert num_steps >= LONG_MAX_TOKENS, stdout  # the replicas' steps, summed (a long request is left)
    assert normalized_records(output_path) == reference
    assert not os.path.exists(partial_path)


def test_tensor_parallel_with_ray_is_refused_before_loading(tmp_path):
    input_path = tmp_path / "in.jsonl"
    input_path.write_text(json.dumps(LINES[0]) + "\n")
    command = _command(input_path, tmp_path / "out.jsonl", "--ray", "--tensor-parallel-size", "2")
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: --tensor-parallel-size > 1 does not work with --ray (each replica runs one unsplit engine): "
        "drop one of them"]
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]
