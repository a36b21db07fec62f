"""Load a script of benchmarks/ as a module, so that tests can call its functions."""

import importlib.util
import sys
from pathlib import Path


def load_benchmark_script(file_name: str):
    """benchmarks/<file_name> as a module named after it (registered in sys.modules: a
    script's dataclasses look their module up there)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / file_name
    spec = importlib.util.spec_from_file_location(f"{path.stem}_script", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
