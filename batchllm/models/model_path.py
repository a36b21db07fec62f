"""Where the files of a --model value are (torch-free): the default model, a .gguf file, a
Hugging Face model directory, or a Hugging Face model id (`org/name`) found in the local
Hugging Face cache (huggingface_hub's layout, HF_HUB_CACHE or HF_HOME).

Nothing is downloaded: a batch job runs on files that are fixed before it starts (its journal
records their digest, so a resume never mixes two versions of a model), and a job never waits on
the network. A model id that is not in the cache is refused with the command that downloads it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from batchllm.models.default_model import RANDOM_PREFIX, default_model_path
from batchllm.models.refusals import MODEL_SPECS_TEXT, ModelNotFoundError, UnsupportedModelError

# huggingface_hub's rule for a repo id: "name" or "namespace/name", word characters, "-" and ".".
_REPO_ID = re.compile(r"^(?:[\w][\w.-]*/)?[\w][\w.-]*$")


@dataclass(frozen=True)
class ModelFiles:
    kind: str  # "gguf" | "hf_dir"
    path: Path  # the .gguf file or the model directory
    name: str  # what responses call the model: the model id, the directory's or the file's name


def find_model_files(spec: str | None) -> ModelFiles:
    """The files of spec (None: the default model). A path that exists is taken as a path;
    otherwise a spec shaped like a model id is looked up in the Hugging Face cache.
    ModelNotFoundError or UnsupportedModelError, naming the fix, when it is neither."""
    if spec is None:
        path = default_model_path()
        return ModelFiles("gguf", path, path.stem)
    path = Path(spec).expanduser()
    name = None
    if not path.exists() and _looks_like_model_id(spec):
        path, name = _cached_snapshot(spec), spec
    if path.is_file() and path.suffix == ".gguf":
        return ModelFiles("gguf", path, name or path.stem)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelFiles("hf_dir", path, name or path.name)
    raise _not_a_model(spec, path)


def tokenizer_source(spec: str | None) -> dict:
    """The tokenizer source (see tokenizer.load_tokenizer) of a --model value; None: the default
    model. ValueError for random presets (no tokenizer) and specs that name no model."""
    if spec is not None and spec.startswith(RANDOM_PREFIX):
        raise ValueError(f"{spec} has no tokenizer: text prompts need a real model (or give prompt_token_ids)")
    files = find_model_files(spec)
    return {"kind": files.kind, "path": str(files.path)}


def _looks_like_model_id(spec: str) -> bool:
    return bool(_REPO_ID.match(spec)) and not spec.endswith(".gguf") and ".." not in spec


def _cached_snapshot(model_id: str) -> Path:
    """The snapshot directory of model_id's main revision in the local Hugging Face cache."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(model_id, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError):
        raise ModelNotFoundError(
            f"model {model_id!r} is neither a path nor a model in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}) (fix: download it first with `hf download {model_id}`: batchllm never "
            "downloads)") from None


def _not_a_model(spec: str, path: Path) -> Exception:
    if not path.exists():
        return ModelNotFoundError(f"model {spec!r} not found (fix: check the path; --model takes {MODEL_SPECS_TEXT})")
    if path.is_dir():
        ggufs = sorted(child.name for child in path.glob("*.gguf"))
        if ggufs:
            return UnsupportedModelError(
                f"model {spec!r} is a directory without config.json that holds GGUF files (fix: pass one of them: "
                f"--model {path / ggufs[0]}{' (or ' + ', '.join(ggufs[1:4]) + ')' if len(ggufs) > 1 else ''})")
        return UnsupportedModelError(
            f"model {spec!r} is a directory without config.json (fix: pass the Hugging Face model directory that "
            "holds config.json, *.safetensors and the tokenizer files, or a .gguf file)")
    if path.suffix == ".safetensors":
        return UnsupportedModelError(
            f"model {spec!r} is a weights file (fix: pass the directory that holds it with config.json and the "
            f"tokenizer files: --model {path.parent})")
    return UnsupportedModelError(f"model {spec!r} is neither a .gguf file nor a model directory "
                                 f"(fix: --model takes {MODEL_SPECS_TEXT})")
