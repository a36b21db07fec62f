"""Faults of a job's own files (ENOSPC, EIO) at every write, fsync, rename, truncate, create and
removal a real job makes. The invariant: exit 0 means the output equals an uninterrupted run's;
otherwise exit 2 with one line naming the path and the errno, and running the same command
again completes with the uninterrupted run's output. The operations are enumerated from a real
run (random:tiny, in-process, `os` patched), then failed one at a time."""

import errno
import json
import os
import shutil

import pytest

import batchllm.engines as engines
import batchllm.io.journal as journal_module
from batchllm.cli.main import main
from batchllm.config import engine_config
from batchllm.engine.llm_engine import LLMEngine
from model_helpers import normalized_records

MODEL = "random:tiny"
KV_TOKENS = 256
LINES = [{"custom_id": f"r{i}", "prompt_token_ids": [3 + i, 9, 17 + 2 * i], "max_tokens": 3, "temperature": 0,
          "ignore_eos": True} for i in range(5)]
LINES.insert(2, "{broken json")
# the operations that change a file; an `open` counts when it may create or write
PATCHED = ("write", "pwrite", "fsync", "replace", "rename", "ftruncate", "remove", "unlink", "open")


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(engine_config(MODEL, kv_cache_tokens=KV_TOKENS))


@pytest.fixture
def jobs(engine, monkeypatch, tmp_path):
    """Run the job's command in-process on the module's engine; sync only at window ends, so
    that every run makes the same operations."""
    monkeypatch.setattr(engines, "build_engine", lambda config: engine)
    monkeypatch.setattr(journal_module, "SYNC_EVERY_SECONDS", 1e9)
    return _Jobs(tmp_path)


class _Jobs:
    def __init__(self, root):
        self.root, self.count = root, 0

    def new_dir(self, like=None):
        self.count += 1
        directory = self.root / f"job{self.count}"
        if like is None:
            directory.mkdir()
            (directory / "in.jsonl").write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n"
                                                        for x in LINES))
        else:
            shutil.copytree(like, directory)
        return directory

    def run(self, directory, capsys, faults=None):
        """(exit code, stderr) of the command in directory, with `faults` patched into os."""
        with pytest.MonkeyPatch.context() as patch:
            if faults is not None:
                for name in PATCHED:
                    patch.setattr(os, name, faults.wrap(name, getattr(os, name), str(directory)))
            code = main(["run", str(directory / "in.jsonl"), "-o", str(directory / "out.jsonl"), "--errors",
                         str(directory / "errors.jsonl"), "--model", MODEL, "--kv-cache-tokens", str(KV_TOKENS),
                         "--window", "2", "--no-progress"])
        return code, capsys.readouterr().err


class _Faults:
    """Counts the file operations under one directory; fails the one numbered `fail_at` (if
    any) with `error`; when `torn` (a write), that write writes half its bytes and the next write
    to the file fails."""

    def __init__(self, fail_at=None, error=None, torn=False):
        self.fail_at, self.error, self.torn = fail_at, error, torn
        self.torn_path = None
        self.operations = []  # (name, path in the directory)
        self.failed = None

    def wrap(self, name, real, directory):
        def operation(*args, **kwargs):
            path = _path_of(name, args)
            if name == "open" and not (args[1] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)):
                path = None  # a read
            if path is None or not path.startswith(directory):
                return real(*args, **kwargs)
            if self.failed is not None and self.torn and name == "write" and path == self.torn_path:
                raise OSError(self.error, os.strerror(self.error))  # the write after a short one
            index = len(self.operations)
            self.operations.append((name, os.path.relpath(path, directory)))
            if index != self.fail_at:
                return real(*args, **kwargs)
            self.failed = self.operations[-1]
            if self.torn:  # as a full disk does: a short write, then the error on the next one
                self.torn_path = path
                return real(args[0], bytes(args[1])[:max(1, len(args[1]) // 2)])
            raise OSError(self.error, os.strerror(self.error))
        return operation


def _path_of(name, args):
    target = args[0]
    if name in ("replace", "rename"):
        return os.fspath(args[1])
    if isinstance(target, int):
        try:
            return os.readlink(f"/proc/self/fd/{target}")
        except OSError:
            return None
    return os.path.abspath(os.fspath(target))


def _outputs(directory):
    return normalized_records(directory / "out.jsonl"), normalized_records(directory / "errors.jsonl")


def _check_every_fault(jobs, capsys, start, reference):
    """Fail each operation of a run from directory `start` in turn, with each error."""
    recorder = _Faults()
    directory = jobs.new_dir(start)
    code, err = jobs.run(directory, capsys, recorder)
    assert code == 0 and _outputs(directory) == reference, err
    operations = recorder.operations
    assert {name for name, _ in operations} >= {"write", "fsync", "replace", "open", "remove"}
    num_stopped = 0
    for index in range(len(operations)):
        for error, torn in ((errno.ENOSPC, False), (errno.EIO, False), (errno.ENOSPC, True)):
            if torn and operations[index][0] != "write":
                continue
            faults = _Faults(index, error, torn)
            directory = jobs.new_dir(start)
            code, err = jobs.run(directory, capsys, faults)
            case = (operations[index], errno.errorcode[error], torn, err)
            assert faults.failed == operations[index], case  # the same operations, in the same order
            if code == 0:
                assert _outputs(directory) == reference, case
                continue
            num_stopped += 1
            error_lines = [line for line in err.splitlines() if line.startswith("error:")]
            assert code == 2 and len(error_lines) == 1 and "note:" not in err, case  # one line says it all
            named = os.path.basename(faults.failed[1]) if faults.failed[1] != "." else directory.name
            if named.endswith(".probe"):  # the check that a path can be written names that path
                named = named[1:].rsplit(".", 2)[0]
            assert named in error_lines[0] and errno.errorcode[error] in error_lines[0], case
            assert "Traceback" not in err, case
            code, err = jobs.run(directory, capsys)  # the same command again
            assert code == 0 and _outputs(directory) == reference, (case, err)
            assert sorted(os.listdir(directory)) == ["errors.jsonl", "in.jsonl", "out.jsonl"], case
    return operations, num_stopped


def test_a_fault_at_any_file_operation_stops_the_job_or_leaves_the_output_right(engine, jobs, capsys):
    reference_dir = jobs.new_dir()
    assert jobs.run(reference_dir, capsys)[0] == 0
    reference = _outputs(reference_dir)
    assert len(reference[0]) == 6 and len(reference[1]) == 1
    operations, num_stopped = _check_every_fault(jobs, capsys, jobs.new_dir(), reference)
    assert len(operations) >= 20 and num_stopped >= len(operations)  # nearly every fault stops the job


def test_a_fault_while_resuming_a_torn_journal_stops_the_job_or_leaves_the_output_right(engine, jobs, capsys):
    reference_dir = jobs.new_dir()
    assert jobs.run(reference_dir, capsys)[0] == 0
    reference = _outputs(reference_dir)
    start = jobs.new_dir()  # a job stopped by EIO on its second journal fsync, then a torn last line
    recorder = _Faults()
    jobs.run(jobs.new_dir(start), capsys, recorder)
    syncs = [i for i, (name, path) in enumerate(recorder.operations) if name == "fsync" and path.endswith(".partial")]
    code, err = jobs.run(start, capsys, _Faults(syncs[1], errno.EIO))
    assert code == 2 and "EIO" in err and "out.jsonl.partial" in err
    with open(start / "out.jsonl.partial", "ab") as handle:
        handle.write(b'4\t00000000000000ab\t{"custom_id": "r3", "resp')
    operations, _ = _check_every_fault(jobs, capsys, start, reference)
    assert "ftruncate" in {name for name, _ in operations}  # the torn line is cut off


def test_a_file_system_that_does_not_sync_directories_is_left_alone(tmp_path, monkeypatch):
    from batchllm.io.job_io import JobFileError, fsync_directory

    fsync = os.fsync
    for code in (errno.EINVAL, errno.EIO):
        def failing(fd, code=code):
            if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")):
                raise OSError(code, os.strerror(code))
            return fsync(fd)
        monkeypatch.setattr(os, "fsync", failing)
        if code == errno.EINVAL:
            fsync_directory(str(tmp_path / "out.jsonl"))  # not supported: nothing to make durable
        else:
            with pytest.raises(JobFileError, match=r"cannot sync the directory .*\(EIO\)"):
                fsync_directory(str(tmp_path / "out.jsonl"))
