"""A made-up byte-level vocabulary of any size, for models without a tokenizer (random-weight
presets): benchmarks measure structured outputs on it, tests drive the grammars through the
engine with it. Its text is never shown to anyone: such a model's answers have no text."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from batchllm.structured.vocabulary import GrammarVocabulary

# Pieces of the kind a BPE vocabulary holds besides words: JSON punctuation runs and indents.
_PUNCTUATION = ['":', '",', '{"', '"}', '},', '],', '["', '"]', ': ', ', ', '\n ', '\n  ', '\n    ', ' {', ' [',
                '":"', '","', '":{"', '":["', '"},{"', '://', '.com']


def synthetic_vocabulary(vocab_size: int, stop_token_ids: Iterable[int], seed: int = 0) -> GrammarVocabulary:
    """stop_token_ids are special (no bytes); then each of the 256 bytes, the punctuation pieces,
    and the rest words of 2-10 letters or digits, a third of them after a space (a deterministic
    draw: the same arguments give the same vocabulary)."""
    stops = set(stop_token_ids)
    pieces: list[bytes] = [bytes([b]) for b in range(256)] + [p.encode() for p in _PUNCTUATION]
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", dtype=np.uint8)
    num_words = max(0, vocab_size - len(stops) - len(pieces))
    lengths = rng.integers(2, 11, size=num_words)
    chars = letters[rng.integers(0, 26, size=int(lengths.sum()))]  # mostly lower case
    other = rng.random(chars.shape[0]) < 0.1  # a tenth upper case or digits
    chars[other] = letters[rng.integers(26, letters.shape[0], size=int(other.sum()))]
    spaced = rng.random(num_words) < 1 / 3
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    seen = set(pieces)
    for index in range(num_words):
        word = (b" " if spaced[index] else b"") + chars[offsets[index]:offsets[index + 1]].tobytes()
        pieces.append(word if word not in seen else word + str(index).encode())
        seen.add(pieces[-1])
    token_bytes, next_piece = [], iter(pieces)
    for token_id in range(vocab_size):
        token_bytes.append(b"" if token_id in stops else next(next_piece))
    return GrammarVocabulary.from_token_bytes(token_bytes, stops, vocab_size, stops)
