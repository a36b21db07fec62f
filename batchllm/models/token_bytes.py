"""Each token's own bytes, read from the tokenizer's vocabulary (torch-free).

Decoding one token alone cannot give them: a token holding part of a UTF-8 character decodes
to U+FFFD. The vocabulary holds the real bytes, written one of two ways:
  byte-level BPE (GPT-2 style, the ByteLevel decoder): every byte is a printable character of
    GPT-2's byte-to-character table;
  SentencePiece with byte fallback: a byte token is "<0xNN>", other pieces are text with "▁"
    for a space (the decoder's Replace rule).
Added tokens (special ones such as <|im_end|>) are plain text. A tokenizer of another kind
(WordPiece, ...) has no partial-character tokens: its tokens' bytes are their decoded text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's character -> byte table (the inverse of its bytes_to_unicode). Written here:
    transformers keeps it only inside its private conversion modules."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


@dataclass(frozen=True)
class VocabularyBytes:
    """token id -> its bytes, and the special token ids that decoding with
    skip_special_tokens=True leaves out of the text."""

    token_bytes: tuple[bytes, ...]
    skipped_ids: frozenset[int]
    num_stripped_spaces: int = 0  # leading spaces the decoder strips off a text (SentencePiece's Strip)

    @classmethod
    def from_hf(cls, hf) -> VocabularyBytes:
        size = len(hf)
        pieces = hf.convert_ids_to_tokens(list(range(size)))
        added = {token_id: token.content for token_id, token in hf.added_tokens_decoder.items()}
        to_bytes = _piece_decoder(hf)
        token_bytes = []
        for token_id, piece in enumerate(pieces):
            if token_id in added:
                token_bytes.append(added[token_id].encode("utf-8"))
            elif piece is None or to_bytes is None:
                token_bytes.append(hf.decode([token_id], skip_special_tokens=False).encode("utf-8"))
            else:
                token_bytes.append(to_bytes(piece))
        skipped = frozenset(token_id for token_id in added if token_id < size and
                            hf.decode([token_id], skip_special_tokens=True) == "")
        return cls(tuple(token_bytes), skipped, _num_stripped_spaces(hf))


def _piece_decoder(hf):
    """piece -> bytes for this tokenizer's vocabulary, or None when it has none of the known kinds."""
    if getattr(hf, "backend_tokenizer", None) is None:
        return None
    decoders = _decoder_steps(_decoder_json(hf))
    kinds = {step.get("type") for step in decoders}
    if "ByteLevel" in kinds:
        table = gpt2_byte_decoder()

        def byte_level(piece: str) -> bytes:
            if all(char in table for char in piece):
                return bytes(table[char] for char in piece)
            return piece.encode("utf-8")

        return byte_level
    replacements = [(step["pattern"]["String"], step["content"]) for step in decoders
                    if step.get("type") == "Replace" and "String" in step.get("pattern", {})]
    replacements += [(step.get("replacement", "▁"), " ") for step in decoders if step.get("type") == "Metaspace"]
    if "ByteFallback" in kinds or replacements:

        def sentencepiece(piece: str) -> bytes:
            if "ByteFallback" in kinds and (match := _BYTE_PIECE.fullmatch(piece)):
                return bytes([int(match.group(1), 16)])
            for pattern, content in replacements:
                piece = piece.replace(pattern, content)
            return piece.encode("utf-8")

        return sentencepiece
    return None


def _decoder_json(hf) -> dict | None:
    """The decoder's settings as in tokenizer.json (its pickled state is that JSON; serializing
    the whole tokenizer would also write every merge)."""
    decoder = getattr(getattr(hf, "backend_tokenizer", None), "decoder", None)
    return None if decoder is None else json.loads(decoder.__getstate__())


def _num_stripped_spaces(hf) -> int:
    return sum(step.get("start", 0) for step in _decoder_steps(_decoder_json(hf))
               if step.get("type") == "Strip" and step.get("content") == " ")


def _decoder_steps(decoder: dict | None) -> list[dict]:
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [step for inner in decoder.get("decoders", []) for step in _decoder_steps(inner)]
    return [decoder]
