"""The crash-safe journal: torn and corrupt lines, header checks, final order, errors file."""

import json

import pytest

from batchllm.io.batch_output import dumps, error_line
from batchllm.io.journal import Journal, JournalHeader, JournalMismatchError
from batchllm.io.token_store import TokenStore

HEADER = JournalHeader(input_size_bytes=123, model="m")


def _record(custom_id, text):
    return {"custom_id": custom_id, "response": {"body": {"text": text}}, "error": None}


def _append(journal, line, record):
    journal.append(line, record, dumps(record))


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
        handle.write(b'3\t{"custom_id": "c", "resp')  # killed mid-write
    resumed = Journal(path, HEADER)
    assert resumed.resume.num_entries == 2 and resumed.resume.num_torn_bytes == 26
    assert (1, "a") in resumed.done and (2, "b") in resumed.done and (3, "c") not in resumed.done
    assert (1, "b") not in resumed.done  # same line, other custom_id: not done
    _append(resumed, 3, _record("c", "z"))
    resumed.finalize(str(tmp_path / "out.jsonl"))
    assert [r["custom_id"] for r in _lines(tmp_path / "out.jsonl")] == ["a", "b", "c"]


def test_a_complete_json_last_line_without_newline_is_torn_too(tmp_path):
    path = str(tmp_path / "out.jsonl.partial")
    journal = Journal(path, HEADER)
    _append(journal, 1, _record("a", "x"))
    journal.close()
    with open(path, "ab") as handle:
        handle.write(b"2\t" + dumps(_record("b", "y")).encode())
    assert Journal(path, HEADER).resume.num_entries == 1


def test_corrupt_middle_line_is_dropped_and_recomputed(tmp_path):
    path = str(tmp_path / "out.jsonl.partial")
    journal = Journal(path, HEADER)
    _append(journal, 1, _record("a", "x"))
    journal.close()
    with open(path, "ab") as handle:  # e.g. a power loss that kept later blocks but not this one
        handle.write(b"\x00\x00garbage\n" + b"2\t" + dumps(_record("b", "y")).encode() + b"\n")
    resumed = Journal(path, HEADER)
    assert (resumed.resume.num_entries, resumed.resume.num_corrupt_lines) == (2, 1)
    resumed.finalize(str(tmp_path / "out.jsonl"))
    assert [r["custom_id"] for r in _lines(tmp_path / "out.jsonl")] == ["a", "b"]


def test_other_input_or_model_is_refused_and_restart_starts_over(tmp_path):
    path = str(tmp_path / "out.jsonl.partial")
    journal = Journal(path, HEADER)
    _append(journal, 1, _record("a", "x"))
    journal.close()
    with pytest.raises(JournalMismatchError, match="--restart"):
        Journal(path, JournalHeader(input_size_bytes=124, model="m"))
    with pytest.raises(JournalMismatchError, match="another input or model"):
        Journal(path, JournalHeader(input_size_bytes=123, model="other"))
    fresh = Journal(path, HEADER, restart=True)
    assert fresh.num_entries == 0 and (1, "a") not in fresh.done


def test_unicode_records_round_trip(tmp_path):
    path = str(tmp_path / "out.jsonl")
    journal = Journal(path + ".partial", HEADER)
    _append(journal, 1, _record("é\t中", "tab\tand\nnewline 🙂"))
    journal.close()
    resumed = Journal(path + ".partial", HEADER)
    assert (1, "é\t中") in resumed.done
    resumed.finalize(path)
    assert _lines(path)[0]["response"]["body"]["text"] == "tab\tand\nnewline 🙂"


def test_token_store_holds_int32_views():
    store = TokenStore(initial_num_tokens=2)
    for prompt in ([1, 2, 3], (7,), [5, 6]):
        store.append(prompt)
    assert len(store) == 3 and store.num_tokens == 6
    assert [v.tolist() for v in store.views()] == [[1, 2, 3], [7], [5, 6]]
    assert store[1].dtype.name == "int32" and store[2].tolist() == [5, 6]
