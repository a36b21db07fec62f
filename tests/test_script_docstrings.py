"""The help texts of the scripts and commands: a shell command in a module docstring that goes on
with a trailing backslash keeps it, so that `--help` shows the command as it is typed (in a plain
string literal Python joins the two lines)."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("batchllm/**/*.py")])


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_docstring_commands_keep_their_line_continuations(path):
    module = ast.parse(path.read_text())
    if not (module.body and isinstance(module.body[0], ast.Expr) and isinstance(module.body[0].value, ast.Constant)):
        return
    literal = ast.get_source_segment(path.read_text(), module.body[0].value)
    joined = re.search(r"(?<!\\)(\\\\)*\\\n", literal)  # an odd run of backslashes ends the line
    assert joined is None or literal[0] in "rR", f"{path.name}: write \\\\ or a raw docstring"
