"""`batchllm run --chat-template FILE`: the file's Jinja template renders the chat lines; a file
that cannot be read or compiled is refused before any work; a resume under another template is
refused (its digest is in the journal header)."""

import json
import os

import pytest

from batchllm.cli.chat_template import load_chat_template
from batchllm.cli.main import main
from batchllm.io.journal import JournalMismatchError
from batchllm.job.batch_job import BatchJobOptions, StopRequest, run_batch_file

pytest_plugins = ["model_fixtures"]

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def _chat_line(custom_id, content):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0}}


def _write(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def test_the_template_is_a_file_or_inline_jinja(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE  # vLLM reads a value with Jinja syntax as the template
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match=r"^chat template file 'missing.jinja' not found \(fix: check the path"):
        load_chat_template("missing.jinja")
    path.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    with pytest.raises(ValueError, match=rf"^chat template {path}, line 2: unexpected '}}' \(fix: correct the "):
        load_chat_template(str(path))


def test_a_bad_template_is_refused_before_any_work(tmp_path, capsys):
    input_path = _write(tmp_path / "in.jsonl", [_chat_line("a", "Hi")])
    output = tmp_path / "out.jsonl"
    code = main(["run", input_path, "-o", str(output), "--model", "random:tiny", "--chat-template",
                 str(tmp_path / "nope.jinja")])
    assert code == 2
    assert capsys.readouterr().err.strip() == (f"error: chat template file '{tmp_path / 'nope.jinja'}' not found "
                                               "(fix: check the path of the Jinja file)")
    assert os.listdir(tmp_path) == ["in.jsonl"]


@pytest.mark.default_model
def test_chat_lines_are_rendered_with_the_template(tmp_path, cli_default_engine, default_engine):
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    input_path = _write(tmp_path / "in.jsonl", [
        _chat_line("chat", "Hi"),
        {"custom_id": "text", "prompt": "Hi", "max_tokens": 2, "temperature": 0}])
    output = tmp_path / "out.jsonl"
    assert main(["run", input_path, "-o", str(output), "--no-progress", "--chat-template", str(template)]) == 0
    usage = {record["custom_id"]: record["response"]["body"]["usage"]["prompt_tokens"]
             for record in map(json.loads, output.read_text().splitlines())}
    hf = default_engine.tokenizer.hf
    assert usage == {"chat": len(hf("user: Hi\nassistant:", add_special_tokens=False).input_ids),
                     "text": len(hf("Hi").input_ids)}


class _StopAfterOneRecord(StopRequest):
    def __init__(self, journal_path):
        super().__init__()
        self.journal_path = journal_path

    @property
    def requested(self):
        if self.signal_name is None and os.path.exists(self.journal_path):
            with open(self.journal_path, "rb") as handle:
                if any(not line.startswith(b"#") for line in handle):
                    self.signal_name, self.exit_code = "SIGTERM", 143
        return self.signal_name is not None


@pytest.mark.default_model
def test_a_resume_under_another_template_is_refused(tmp_path, default_engine):
    input_path = _write(tmp_path / "in.jsonl", [_chat_line("a", "Hi"), _chat_line("b", "Hello")])
    output = str(tmp_path / "out.jsonl")

    def options(template):
        return BatchJobOptions(show_progress=False, window_num_requests=1, chat_template=template)

    summary = run_batch_file(default_engine, input_path, output, options(TEMPLATE),
                             stop=_StopAfterOneRecord(output + ".partial"))
    assert summary.interrupted_by == "SIGTERM"
    with pytest.raises(JournalMismatchError, match=r"--chat-template \(a digest of its text\) '[0-9a-f]{16}' -> None"):
        run_batch_file(default_engine, input_path, output, options(None))
    summary = run_batch_file(default_engine, input_path, output, options(TEMPLATE))
    assert (summary.num_requests, summary.num_resumed) == (2, 1)
