"""Prompt token ids of a batch file's lines for the model-free commands (`analyze`, `simulate`).

Lines with prompt_token_ids need no model and no torch. Text prompts and chat messages are
encoded with the tokenizer (and chat template) of --model, the default model when none is given,
loaded once, on the first line that needs it.
"""

from __future__ import annotations

import argparse


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="a .gguf file, Hugging Face model directory or cached model id whose tokenizer encodes "
                             "text prompts "
                             "(default: SmolLM2-135M-Instruct, the default model of `batchllm run`)")


def read_prompts(path: str, model: str | None, where: str = ""):
    """(item, prompt token ids) for each line: a BatchRequest, or a BatchError with no ids. A text
    that cannot be tokenized raises ValueError("{where}line N: why")."""
    from batchllm.models.model_path import tokenizer_source
    from batchllm.io.batch_input import BatchError, read_batch_file
    from batchllm.models.tokenizer import load_tokenizer

    tokenizer = None
    for item in read_batch_file(path):
        if isinstance(item, BatchError):
            yield item, ()
        elif item.prompt_token_ids is not None:
            yield item, item.prompt_token_ids
        else:
            try:
                tokenizer = tokenizer or load_tokenizer(tokenizer_source(model))
                chat = item.messages is not None
                token_ids = tokenizer.encode_chat(item.messages) if chat else tokenizer.encode_prompt(item.prompt)
            except (ValueError, OSError) as error:
                raise ValueError(f"{where}line {item.line_number}: {error}") from None
            yield item, token_ids
