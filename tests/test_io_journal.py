"""The crash-safe journal: torn and corrupt lines, header checks, per-line digests, final
order, errors file."""

import json

import pytest

from batchllm.io.batch_output import dumps, error_line
from batchllm.io.compact_set import Int64Set, digest64
from batchllm.io.journal import Journal, JournalHeader, JournalMismatchError
from batchllm.io.token_store import TokenStore

HEADER = JournalHeader({"model": "m", "seed": 0})


def _record(custom_id, text):
    return {"custom_id": custom_id, "response": {"body": {"text": text}}, "error": None}


def _append(journal, line, record, digest=None):
    journal.append(line, record, dumps(record), line * 1000 if digest is None else digest)


def _lines(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def test_final_file_in_input_order_and_finish_order(tmp_path):
    for order, expected in (("input", ["a", None, "c", "d"]), ("finish", ["c", "a", None, "d"])):
        path = str(tmp_path / f"{order}.jsonl")
        journal = Journal(path + ".partial", HEADER)
        _append(journal, 3, _record("c", "z"))
        _append(journal, 1, _record("a", "x"))
        _append(journal, 2, error_line(None, "invalid_json", "bad", 2))
        _append(journal, 4, _record("d", "w"))
        assert journal.counts() == (3, 1)
        journal.finalize(path, order, errors_path=path + ".errors")
        assert [r["custom_id"] for r in _lines(path)] == expected
        assert [r["error"]["line"] for r in _lines(path + ".errors")] == [2]
        assert not (tmp_path / f"{order}.jsonl.partial").exists()


def test_resume_drops_a_torn_last_line_and_keeps_the_rest(tmp_path):
    path = str(tmp_path / "out.jsonl.partial")
    journal = Journal(path, HEADER)
    _append(journal, 1, _record("a", "x"))
    _append(journal, 2, _record("b", "y"))
    journal.close()
    with open(path, "ab") as handle:
        handle.write(b'3\t0000000000000bb8\t{"custom_id": "c", "resp')  # killed mid-write
    resumed = Journal(path, HEADER)
    assert resumed.resume.num_entries == 2 and resumed.resume.num_torn_bytes == 43
    assert resumed.keep(1, 1000) and resumed.keep(2, 2000) and not resumed.keep(3, 3000)
    _append(resumed, 3, _record("c", "z"))
    resumed.finalize(str(tmp_path / "out.jsonl"))
    assert [r["custom_id"] for r in _lines(tmp_path / "out.jsonl")] == ["a", "b", "c"]


def test_a_changed_line_is_dropped_and_an_unconfirmed_entry_never_reaches_the_output(tmp_path):
    path = str(tmp_path / "out.jsonl.partial")
    journal = Journal(path, HEADER)
    for line in (1, 2, 3):
        _append(journal, line, _record(f"r{line}", "old"))
    journal.close()
    resumed = Journal(path, HEADER)
    assert resumed.keep(1, 1000)
    assert not resumed.keep(2, 4242)  # line 2 was edited: answered again
    assert resumed.num_changed == 1 and not resumed.keep(2, 2000)  # its old entry is gone for good
    _append(resumed, 2, _record("r2", "new"), 4242)
    # line 3 is never reached (the input now has 2 lines): its entry is not written
    assert resumed.counts() == (2, 0) and resumed.counts(confirmed_only=False) == (3, 0)
    resumed.finalize(str(tmp_path / "out.jsonl"))
    assert [(r["custom_id"], r["response"]["body"]["text"]) for r in _lines(tmp_path / "out.jsonl")] == [
        ("r1", "old"), ("r2", "new")]


def test_a_later_entry_supersedes_an_earlier_one_and_out_of_range_entries_are_dropped(tmp_path):
    path = str(tmp_path / "out.jsonl.partial")
    journal = Journal(path, HEADER)
    _append(journal, 1, _record("first", "x"))
    _append(journal, 1, _record("second", "y"))  # a later run answered line 1 again (it did not keep it)
    _append(journal, 40, _record("far", "z"))  # a line the 12-line input does not have
    journal.close()
    resumed = Journal(path, HEADER, num_input_lines=12)
    report = resumed.resume
    assert (report.num_entries, report.num_superseded, report.num_out_of_range) == (1, 1, 1)
    assert resumed.keep(1, 1000)
    resumed.finalize(str(tmp_path / "out.jsonl"))
    assert [r["custom_id"] for r in _lines(tmp_path / "out.jsonl")] == ["second"]


def test_a_complete_json_last_line_without_newline_is_torn_too(tmp_path):
    path = str(tmp_path / "out.jsonl.partial")
    journal = Journal(path, HEADER)
    _append(journal, 1, _record("a", "x"))
    journal.close()
    with open(path, "ab") as handle:
        handle.write(b"2\t00000000000007d0\t" + dumps(_record("b", "y")).encode())
    assert Journal(path, HEADER).resume.num_entries == 1


def test_corrupt_middle_line_is_dropped_and_recomputed(tmp_path):
    path = str(tmp_path / "out.jsonl.partial")
    journal = Journal(path, HEADER)
    _append(journal, 1, _record("a", "x"))
    journal.close()
    with open(path, "ab") as handle:  # e.g. a power loss that kept later blocks but not this one
        handle.write(b"\x00\x00garbage\n" + b"2\t00000000000007d0\t" + dumps(_record("b", "y")).encode() + b"\n")
    resumed = Journal(path, HEADER)
    assert (resumed.resume.num_entries, resumed.resume.num_corrupt_lines) == (2, 1)
    assert resumed.keep(1, 1000) and resumed.keep(2, 2000)
    resumed.finalize(str(tmp_path / "out.jsonl"))
    assert [r["custom_id"] for r in _lines(tmp_path / "out.jsonl")] == ["a", "b"]


def test_other_options_are_refused_by_name_and_restart_starts_over(tmp_path):
    path = str(tmp_path / "out.jsonl.partial")
    journal = Journal(path, HEADER)
    _append(journal, 1, _record("a", "x"))
    journal.close()
    with pytest.raises(JournalMismatchError, match=r"seed 0 -> 5.*--restart"):
        Journal(path, JournalHeader({"model": "m", "seed": 5}))
    with pytest.raises(JournalMismatchError, match="model 'm' -> 'other'"):
        Journal(path, JournalHeader({"model": "other", "seed": 0}))
    fresh = Journal(path, HEADER, restart=True)
    assert fresh.num_changed == 0 and not fresh.keep(1, 1000)


def test_an_older_journal_format_is_refused(tmp_path):
    path = tmp_path / "out.jsonl.partial"
    path.write_bytes(b'#batchllm-journal v1\t{"input_size_bytes": 5, "model": "m"}\n'
                     b'1\t{"custom_id": "a", "error": null}\n')
    with pytest.raises(JournalMismatchError, match="older batchllm.*--restart"):
        Journal(str(path), HEADER)


def test_unicode_records_round_trip(tmp_path):
    path = str(tmp_path / "out.jsonl")
    journal = Journal(path + ".partial", HEADER)
    _append(journal, 1, _record("é\t中", "tab\tand\nnewline 🙂"), digest=-5)
    journal.close()
    resumed = Journal(path + ".partial", HEADER)
    assert resumed.keep(1, -5)  # negative digests round-trip through the hex form
    resumed.finalize(path)
    assert _lines(path)[0]["response"]["body"]["text"] == "tab\tand\nnewline 🙂"


def test_int64_set_finds_exactly_what_was_added():
    keys = Int64Set(initial_capacity=4)
    values = [digest64(str(i).encode()) for i in range(5000)] + [0, 1]
    assert all(keys.add(v) for v in values[:-1])  # 0 is stored as 1: the last add is a repeat
    assert not keys.add(values[-1])
    assert not any(keys.add(v) for v in values) and keys.add(digest64(b"absent"))  # every key is found
    assert keys._slots.nbytes <= 16 * 2 * 5002  # two 8-byte slots per key at most


def test_token_store_holds_int32_views():
    store = TokenStore(initial_num_tokens=2)
    for prompt in ([1, 2, 3], (7,), [5, 6]):
        store.append(prompt)
    views = store.views()
    assert [v.tolist() for v in views] == [[1, 2, 3], [7], [5, 6]]
    assert all(v.dtype.name == "int32" for v in views)
