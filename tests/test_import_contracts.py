"""The import contracts of pyproject.toml ([tool.importlinter]: the layers, no torch below the
engine, no cycles) hold, and each of them fails on an import that breaks it."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = ("import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))")


def _lint(root: Path) -> subprocess.CompletedProcess:
    """lint-imports on the batchllm package of root."""
    if importlib.util.find_spec("importlinter") is None:
        pytest.fail("import-linter is not installed: pip install -e '.[dev]' (it is a pinned dev dependency)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", LINT], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_package_keeps_its_import_contracts():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 3 kept, 0 broken." in result.stdout


LAYERS = "Layers: a package imports only the packages below it"
NO_TORCH = "The planners, the scheduler, the request parser and the configuration never import torch"
NO_CYCLES = "No import cycles, between packages or between modules"


@pytest.mark.parametrize("module,line,contract", [
    ("sched/config.py", "import torch", NO_TORCH),
    ("attention_plan/checks.py", "from batchllm import config", LAYERS),  # the planner is below config
    ("engine/batch_rows.py", "from batchllm.engine import step_inputs", NO_CYCLES),  # which imports batch_rows
])
def test_a_broken_import_fails_its_contract(tmp_path, module, line, contract):
    shutil.copytree(ROOT / "batchllm", tmp_path / "batchllm", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    path = tmp_path / "batchllm" / module
    path.write_text(path.read_text() + f"\n\ndef _broken():\n    {line}\n")  # inside a function counts too
    result = _lint(tmp_path)
    report = " ".join(result.stdout.split())
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Contracts: 2 kept, 1 broken." in report
    assert f"{contract} BROKEN" in report
