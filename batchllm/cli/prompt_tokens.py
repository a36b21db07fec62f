"""Prompt token ids of parsed request lines for the model-free commands (`analyze`, `simulate`).

Lines with prompt_token_ids need no model and no torch. Text prompts and chat messages are
encoded with the tokenizer (and chat template) of --model, the default model when none is given,
loaded once, on the first line that needs it.
"""

from __future__ import annotations

import argparse


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """--model of the commands that only tokenize."""
    parser.add_argument("--model", default=None,
                        help="a .gguf file or HF model directory whose tokenizer encodes text prompts "
                             "(default: SmolLM2-135M-Instruct, the default model of `batchllm run`)")


class PromptTokenizer:
    def __init__(self, model: str | None) -> None:
        self.model = model
        self._tokenizer = None

    def token_ids(self, item) -> list[int] | tuple[int, ...]:
        """item: a BatchRequest. Raises ValueError when its text cannot be tokenized."""
        if item.prompt_token_ids is not None:
            return item.prompt_token_ids
        tokenizer = self._load()
        if item.messages is not None:
            return tokenizer.encode_chat(item.messages)
        return tokenizer.encode_prompt(item.prompt)

    def _load(self):
        if self._tokenizer is None:
            from batchllm.default_model import tokenizer_source
            from batchllm.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(tokenizer_source(self.model))
            if self._tokenizer is None:
                raise ValueError(f"--model {self.model!r} has no tokenizer")
        return self._tokenizer
