"""Every file of a job is a distinct file, or the job is refused before it starts; a missing
output directory is named; a closed stdout or stderr and a signal while the output is written
never turn a finished job into a crash or a false message (random:tiny)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from batchllm.cli.main import main
from model_helpers import normalized_records

MODEL = "random:tiny"
MISSING_MODEL = "/nonexistent/model.gguf"  # a refusal must come before the model would load
LINES = [{"custom_id": f"r{i}", "prompt_token_ids": [3 + i, 9, 17], "max_tokens": 3, "temperature": 0,
          "ignore_eos": True} for i in range(4)] + ["{broken"]


def _write(path, lines=LINES):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))


def _cli(capsys, *argv):
    code = main(["run", *map(str, argv), "--no-progress"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("input_name, output_name, errors_name, clash", [
    ("in.jsonl", "out.jsonl", "out.jsonl.tmp", "the temporary output file of -o"),
    ("in.jsonl", "out.jsonl", "out.jsonl.partial", "the journal of -o"),
    ("in.jsonl", "out.jsonl", "out.jsonl.lock", "the lock file of -o"),
    ("in.jsonl", "out.jsonl", "out.jsonl.partial.tmp", "the temporary journal file of -o"),
    ("in.jsonl", "out.jsonl", "out.jsonl", "-o"),
    ("E.tmp", "out.jsonl", "E", "the input file"),  # --errors E writes E.tmp: the input
    ("out.jsonl.partial", "out.jsonl", None, "the input file"),
    ("in.jsonl", "x.tmp", "x", "-o"),  # --errors x writes x.tmp: the output
    ("in.tmp", "in", None, "the input file"),  # -o in writes in.tmp: the input
])
def test_two_files_of_a_job_that_are_one_file_are_refused_before_it_starts(
        tmp_path, capsys, input_name, output_name, errors_name, clash):
    _write(tmp_path / input_name)
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}
    errors = ("--errors", tmp_path / errors_name) if errors_name else ()
    code, _, err = _cli(capsys, tmp_path / input_name, "-o", tmp_path / output_name, *errors, "--model", MISSING_MODEL)
    error_lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(error_lines) == 1 and clash in error_lines[0] and "(fix: choose another" in err, err
    assert "loading model" not in err
    assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)} == before  # nothing touched


def test_a_link_to_a_file_of_the_job_is_the_same_file(tmp_path, capsys):
    _write(tmp_path / "in.jsonl")
    os.symlink(tmp_path / "out.jsonl.partial", tmp_path / "errors.jsonl")  # dangling: resolved by path
    os.link(tmp_path / "in.jsonl", tmp_path / "hard.jsonl")
    for errors, clash in (("errors.jsonl", "the journal of -o"), ("hard.jsonl", "is the input file")):
        code, _, err = _cli(capsys, tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl", "--errors", tmp_path / errors,
                            "--model", MISSING_MODEL)
        assert code == 2 and clash in err, err
    assert sorted(os.listdir(tmp_path)) == ["errors.jsonl", "hard.jsonl", "in.jsonl"]


@pytest.mark.parametrize("flag", ["-o", "--errors"])
def test_a_missing_directory_is_named_with_the_fix(tmp_path, capsys, flag):
    _write(tmp_path / "in.jsonl")
    paths = {"-o": tmp_path / "out.jsonl", "--errors": tmp_path / "errors.jsonl"}
    paths[flag] = tmp_path / "newdir" / "file.jsonl"
    code, _, err = _cli(capsys, tmp_path / "in.jsonl", "-o", paths["-o"], "--errors", paths["--errors"],
                        "--model", MISSING_MODEL)
    assert code == 2 and f"{flag} '{paths[flag]}': the directory '{tmp_path / 'newdir'}' does not exist" in err, err
    assert "(fix: create it, e.g. mkdir -p" in err and "disk space" not in err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def _command(tmp_path, *extra):
    return [sys.executable, "-m", "batchllm.cli.main", "run", str(tmp_path / "in.jsonl"), "-o",
            str(tmp_path / "out.jsonl"), "--model", MODEL, "--kv-cache-tokens", "256", *extra]


@pytest.mark.parametrize("closed", ["stdout", "stdout and stderr"])
def test_a_closed_stdout_or_stderr_does_not_turn_a_finished_job_into_a_traceback(tmp_path, closed):
    _write(tmp_path / "in.jsonl")
    both = closed == "stdout and stderr"
    process = subprocess.Popen(_command(tmp_path), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT if both else subprocess.PIPE)
    process.stdout.close()  # the reader went away (`batchllm run ... | true`)
    stderr = b"" if both else process.stderr.read()
    assert process.wait(timeout=300) == 0, stderr
    assert b"Traceback" not in stderr and b"BrokenPipe" not in stderr
    assert [r["custom_id"] for r in normalized_records(tmp_path / "out.jsonl")] == ["r0", "r1", "r2", "r3", None]


_SIGNAL_WHILE_FINALIZING = textwrap.dedent("""
    import os, signal, sys, time
    from batchllm.cli.main import main

    rename = os.replace
    def signal_then_rename(source, target):  # the output is written, about to be put in place
        if str(source).endswith("out.jsonl.tmp"):
            for _ in range(int(sys.argv[1])):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.5)
        rename(source, target)
    os.replace = signal_then_rename
    sys.exit(main(sys.argv[2:]))
""")


@pytest.mark.parametrize("num_signals", [1, 2])
def test_a_sigterm_while_the_output_is_written_gives_a_true_outcome(tmp_path, capsys, num_signals):
    _write(tmp_path / "in.jsonl")
    reference = tmp_path / "reference"
    reference.mkdir()
    _write(reference / "in.jsonl")
    assert main(_command(reference, "--no-progress")[3:]) == 0
    argv = _command(tmp_path, "--no-progress")[3:]
    process = subprocess.run([sys.executable, "-c", _SIGNAL_WHILE_FINALIZING, str(num_signals), *argv],
                             capture_output=True, text=True, timeout=300)
    journal = tmp_path / "out.jsonl.partial"
    if num_signals == 1:  # finalize finishes: success, honestly reported
        assert process.returncode == 0, process.stderr
        assert "SIGTERM arrived after every line was answered: the output" in process.stderr
        assert "4 requests answered, 1 errors" in process.stdout and not journal.exists()
    else:  # stopped at once: the journal stays, and the same command finishes the output
        assert process.returncode == 143, process.stderr
        assert "is kept: run the same command again to finish it" in process.stderr
        assert journal.exists() and not (tmp_path / "out.jsonl").exists()
        assert main(argv) == 0, capsys.readouterr().err  # the same command again
    assert normalized_records(tmp_path / "out.jsonl") == normalized_records(reference / "out.jsonl")
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "out.jsonl", "reference"]


def test_a_file_of_the_job_that_is_a_directory_or_device_is_refused_before_it_starts(tmp_path, capsys):
    _write(tmp_path / "in.jsonl")
    (tmp_path / "out.jsonl.partial").mkdir()
    code, _, err = _cli(capsys, tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl", "--model", MISSING_MODEL)
    assert code == 2 and "(the journal of -o) is a directory (fix: remove it, or choose another -o path)" in err, err
    code, _, err = _cli(capsys, tmp_path / "in.jsonl", "-o", "/dev/null", "--overwrite", "--model", MISSING_MODEL)
    assert code == 2 and "-o '/dev/null' is not a regular file (fix: choose another -o path)" in err, err
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "out.jsonl.partial"] and "loading model" not in err
