"""Tokenizer and chat template through HF transformers (GGUF and HF directories)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from batchllm.models.refusals import UnsupportedModelError


CAP_MARGIN_TOKENS = 64  # tokens a cut inside the text may merge away (far more than BPE merges across a cut)


class TokenizerUnavailableError(ValueError):
    pass


class Tokenizer:
    """Thin wrapper around a HF tokenizer: prompt/chat encoding and decoding."""

    def __init__(self, hf_tokenizer) -> None:
        self.hf = hf_tokenizer
        self._vocabulary = None

    @property
    def vocabulary(self):
        """VocabularyBytes: each token's real bytes (built on first use: a pass over the vocabulary)."""
        if self._vocabulary is None:
            from batchllm.models.token_bytes import VocabularyBytes

            self._vocabulary = VocabularyBytes.from_hf(self.hf)
        return self._vocabulary

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode_prompt(self, text: str, max_num_tokens: int | None = None) -> list[int]:
        # Same call HF users make (tokenizer(text)), so special tokens such as BOS match theirs.
        return self._encode(text, True, max_num_tokens)

    def render_chat(self, messages: Sequence[dict], chat_template: str | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False) -> str:
        """The prompt text of a conversation, as vLLM and transformers render it: the model's chat
        template (or chat_template, Jinja text), ending with the assistant's header
        (add_generation_prompt) or inside the last message, left open (continue_final_message)."""
        if chat_template is None and not getattr(self.hf, "chat_template", None):
            raise TokenizerUnavailableError("this model's tokenizer has no chat template: use /v1/completions prompts "
                                            "or give a chat template (--chat-template FILE, chat_template=...)")
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true (fix: pass "
                             "add_generation_prompt=False to continue the last message)")
        return self.hf.apply_chat_template(list(messages), chat_template=chat_template, tokenize=False,
                                           add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message)

    def encode_chat(self, messages: Sequence[dict], max_num_tokens: int | None = None,
                    chat_template: str | None = None) -> list[int]:
        return self.encode_rendered_chat(self.render_chat(messages, chat_template), max_num_tokens)

    def encode_rendered_chat(self, text: str, max_num_tokens: int | None = None) -> list[int]:
        """The token ids of render_chat's text: the template wrote the special tokens (BOS
        included) itself, so none are added."""
        return self._encode(text, False, max_num_tokens)

    def _encode(self, text: str, add_special_tokens: bool, max_num_tokens: int | None) -> list[int]:
        """All of text's token ids; with max_num_tokens, a long text is tokenized in growing
        prefixes (4 characters a token, then x4) and tokenizing stops once a prefix has more than
        max_num_tokens + CAP_MARGIN_TOKENS tokens: the result is then that prefix's ids. Time and
        memory stay proportional to the limit, not to the text (a 30 MB prompt takes one short
        call). The margin covers tokens merged across the cut, so a text reported longer than
        the limit is longer."""
        num_chars = len(text) if max_num_tokens is None else 4 * (max_num_tokens + CAP_MARGIN_TOKENS)
        while True:
            token_ids = self.hf(text[:num_chars], add_special_tokens=add_special_tokens).input_ids
            if num_chars >= len(text) or len(token_ids) > max_num_tokens + CAP_MARGIN_TOKENS:
                return list(token_ids)
            num_chars *= 4

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(source: dict | None) -> Tokenizer | None:
    """Load the tokenizer a model loader pointed at; None for models without one (random presets).
    UnsupportedModelError, naming the fix, when transformers cannot build it."""
    if not source or source.get("kind") == "none":
        return None
    from transformers import AutoTokenizer

    kind, path = source["kind"], source["path"]
    if kind not in ("gguf", "hf_dir"):
        raise ValueError(f"unknown tokenizer source kind {kind!r}")
    try:
        if kind == "gguf":
            directory, name = os.path.split(os.path.abspath(path))
            return Tokenizer(AutoTokenizer.from_pretrained(directory, gguf_file=name))
        return Tokenizer(AutoTokenizer.from_pretrained(path))
    except (ValueError, OSError, KeyError) as error:
        what = "the tokenizer files (tokenizer.json, tokenizer_config.json)" if kind == "hf_dir" else \
            "a GGUF whose tokenizer transformers reads"
        reason = " ".join(str(error).split())
        raise UnsupportedModelError(f"cannot load the tokenizer of {path}: {reason} (fix: a model with {what}, "
                                    "as its release has them)") from None
