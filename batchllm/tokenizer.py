"""Tokenizer and chat template through HF transformers (GGUF and HF directories)."""

from __future__ import annotations

import os
from collections.abc import Sequence


class TokenizerUnavailableError(ValueError):
    pass


class Tokenizer:
    """Thin wrapper around a HF tokenizer: prompt/chat encoding and decoding."""

    def __init__(self, hf_tokenizer) -> None:
        self.hf = hf_tokenizer

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode_prompt(self, text: str) -> list[int]:
        # Same call HF users make (tokenizer(text)), so special tokens such as BOS match theirs.
        return list(self.hf(text).input_ids)

    def encode_chat(self, messages: Sequence[dict]) -> list[int]:
        if not getattr(self.hf, "chat_template", None):
            raise TokenizerUnavailableError("this model's tokenizer has no chat template: use /v1/completions prompts")
        text = self.hf.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        return list(self.hf(text, add_special_tokens=False).input_ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(source: dict | None) -> Tokenizer | None:
    """Load the tokenizer a model loader pointed at; None for models without one (random presets)."""
    if not source or source.get("kind") == "none":
        return None
    from transformers import AutoTokenizer

    kind, path = source["kind"], source["path"]
    if kind == "gguf":
        directory, name = os.path.split(os.path.abspath(path))
        return Tokenizer(AutoTokenizer.from_pretrained(directory, gguf_file=name))
    if kind == "hf_dir":
        return Tokenizer(AutoTokenizer.from_pretrained(path))
    raise ValueError(f"unknown tokenizer source kind {kind!r}")
