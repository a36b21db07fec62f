"""The vocabulary a grammar is compiled over: each token id's bytes, the model's vocabulary size
and the end-of-sequence ids (xgrammar's TokenizerInfo)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xgrammar


@dataclass(frozen=True)
class GrammarVocabulary:
    token_bytes: Sequence[bytes]  # token id -> its bytes; b"" for a special token (never part of a text)
    vocab_size: int  # the model's: its logits' width (ids past token_bytes are never allowed)
    stop_token_ids: tuple[int, ...]  # the tokens that end a completed grammar: the engine's EOS ids

    @classmethod
    def from_token_bytes(cls, token_bytes: Sequence[bytes], special_ids: Iterable[int], vocab_size: int,
                         stop_token_ids: Iterable[int]) -> GrammarVocabulary:
        """token_bytes: each token's real bytes (models.token_bytes.VocabularyBytes); special_ids:
        tokens left out of decoded text (their bytes never match a grammar's text)."""
        special = set(special_ids)
        usable = [b"" if token_id in special else piece for token_id, piece in enumerate(token_bytes[:vocab_size])]
        return cls(usable, vocab_size, tuple(sorted(set(stop_token_ids))))

    def tokenizer_info(self) -> xgrammar.TokenizerInfo:
        return xgrammar.TokenizerInfo(list(self.token_bytes), xgrammar.VocabType.RAW, vocab_size=self.vocab_size,
                                      stop_token_ids=list(self.stop_token_ids))
