"""The fixed text of the accuracy benchmarks: the repository's README.md followed by docs/*.md in
sorted order, as token ids cut to a length; token ids also travel as a JSON list (a machine without
the tokenizer's libraries reads them instead of tokenizing). Torch-free."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

DOC_SEPARATOR = "\n\n"


def repo_root() -> Path:
    """The checkout holding this package (where README.md and docs/ are)."""
    return Path(__file__).resolve().parents[2]


def text_files(root: Path) -> list[Path]:
    """README.md, then docs/*.md sorted by name."""
    readme = root / "README.md"
    if not readme.is_file():
        raise FileNotFoundError(f"{readme} is missing: the evaluation text starts with the repository's README.md")
    return [readme] + sorted((root / "docs").glob("*.md"))


def build_text(root: Path) -> str:
    """The files of text_files(root), each ending in its own text, joined by a blank line."""
    return DOC_SEPARATOR.join(path.read_text(encoding="utf-8").rstrip("\n") for path in text_files(root))


def cut_tokens(token_ids: Sequence[int], num_tokens: int) -> list[int]:
    """The first num_tokens ids; an error when there are fewer (a shorter text would change what
    the metrics average over)."""
    if num_tokens < 2:
        raise ValueError(f"num_tokens must be at least 2 (one next-token prediction), got {num_tokens}")
    if len(token_ids) < num_tokens:
        raise ValueError(f"the text has {len(token_ids)} tokens, fewer than the {num_tokens} asked for")
    return [int(token) for token in token_ids[:num_tokens]]


def text_token_ids(model: str | None, num_tokens: int, root: Path | None = None) -> list[int]:
    """build_text(root) through the model's own tokenizer (as the engine loads it), cut to num_tokens."""
    from batchllm.models.model_path import tokenizer_source
    from batchllm.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_source(model))
    if tokenizer is None:
        raise ValueError(f"model {model!r} has no tokenizer: pass a tokens file instead")
    text = build_text(root if root is not None else repo_root())
    return cut_tokens(tokenizer.encode_prompt(text, max_num_tokens=num_tokens), num_tokens)


def write_tokens_file(path: str | Path, token_ids: Sequence[int]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([int(token) for token in token_ids]) + "\n")


def read_tokens_file(path: str | Path) -> list[int]:
    """A JSON list of token ids (as write_tokens_file writes it)."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list) or not all(type(token) is int and token >= 0 for token in data):
        raise ValueError(f"{path}: expected a JSON list of non-negative token ids")
    return data
