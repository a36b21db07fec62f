"""Build OpenAI-Batch output lines (torch-free)."""

from __future__ import annotations

import codecs
import json
import time
import uuid
from collections.abc import Sequence
from typing import Protocol


def success_line(
    custom_id: str,
    endpoint: str,
    model_name: str,
    text: str,
    finish_reason: str,
    num_prompt_tokens: int,
    num_completion_tokens: int,
    num_cached_prompt_tokens: int = 0,
    logprobs: object | None = None,
    prompt_logprobs: list | None = None,
) -> dict:
    """prompt_logprobs (vllm_prompt_logprobs), when asked for: on the choice for completions, on
    the body for chat, where vLLM puts them."""
    usage = {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_prompt_tokens},
    }
    chat = endpoint == "chat"
    answer = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    choice = {"index": 0, **answer, "logprobs": logprobs, "finish_reason": finish_reason}
    body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model_name, "choices": [choice], "usage": usage}
    if prompt_logprobs is not None:
        (body if chat else choice)["prompt_logprobs"] = prompt_logprobs
    response = {"status_code": 200, "request_id": f"req_{uuid.uuid4().hex[:24]}", "body": body}
    return {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": custom_id, "response": response,
            "error": None}


def error_line(custom_id: str | None, code: str, message: str, line_number: int) -> dict:
    error = {"code": code, "message": message, "line": line_number}
    return {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": custom_id, "response": None, "error": error}


def dumps(record: dict) -> str:
    return json.dumps(record, ensure_ascii=False)


class TokenVocabulary(Protocol):
    """Each token's real bytes (batchllm.models.token_bytes.VocabularyBytes)."""

    token_bytes: Sequence[bytes]
    skipped_ids: frozenset[int]  # special tokens the text leaves out
    num_stripped_spaces: int  # leading spaces decoding strips off a text


MIN_LOGPROB = -9999.0  # what OpenAI (and vLLM) write for a logprob too small to show (never -inf)


def token_string(token_id: int, vocabulary: TokenVocabulary | None) -> str:
    """A token as text: its bytes when they are UTF-8; "bytes:\\xNN..." when they are part of a
    character (OpenAI's form, so two tokens never share a string); "token_id:N" without a
    tokenizer (vLLM's return_tokens_as_token_ids form)."""
    data = _token_bytes(token_id, vocabulary)
    if data is None:
        return f"token_id:{token_id}"
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in data)


def openai_logprobs(
    endpoint: str,
    token_ids: Sequence[int],
    entries: Sequence[dict[int, float]],
    num_top: int,
    vocabulary: TokenVocabulary | None,
    text: str,
    skip_special_tokens: bool = True,
) -> dict:
    """The `logprobs` of a choice, in the endpoint's OpenAI shape.

    entries: per generated token, {token_id: logprob} holding the sampled token and the
    position's num_top most likely tokens (num_top or num_top + 1 items). vocabulary: None
    for a model without a tokenizer (tokens are then "token_id:N", bytes null). text: the
    choice's text, which text_offset indexes. skip_special_tokens: whether the text leaves out
    the vocabulary's special tokens (the request's skip_special_tokens).
    chat:       {"content": [{token, logprob, bytes, top_logprobs: [num_top x {token, logprob, bytes}]}]}
                top_logprobs is the position's top num_top, whether or not the sampled token is in it;
                bytes are the token's own bytes, so the tokens' bytes joined are the text's UTF-8.
    completion: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}
                each top_logprobs dict holds the top num_top plus the sampled token (so up to
                num_top + 1 keys, as OpenAI documents), one key per token id: a token whose
                string an earlier key of the dict already has (the sampled token's first) is
                keyed "token_id:N". text_offset: where each token's text starts in the text,
                in characters (a token that starts inside a character: that character's start).
    """
    if endpoint == "chat":
        return {"content": [_chat_token(token_id, entry, num_top, vocabulary)
                            for token_id, entry in zip(token_ids, entries)]}
    return {
        "tokens": [token_string(token_id, vocabulary) for token_id in token_ids],
        "token_logprobs": [_logprob(entry[token_id]) for token_id, entry in zip(token_ids, entries)],
        "top_logprobs": [_distinct_keys(token_id, entry, vocabulary) for token_id, entry in zip(token_ids, entries)],
        "text_offset": text_offsets(token_ids, vocabulary, text, skip_special_tokens),
    }


def text_offsets(token_ids: Sequence[int], vocabulary: TokenVocabulary | None, text: str,
                 skip_special_tokens: bool = True) -> list[int]:
    """Where each token starts in text, in characters: the characters its preceding tokens' bytes
    complete (a skipped special token adds none, with skip_special_tokens), less the leading
    spaces decoding strips; at most len(text) (a text cut at a stop string ends before the last
    tokens)."""
    if vocabulary is None:
        return [0] * len(token_ids)
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    skipped_ids = vocabulary.skipped_ids if skip_special_tokens else frozenset()
    num_chars, num_to_strip, offsets = 0, vocabulary.num_stripped_spaces, []
    for token_id in token_ids:
        offsets.append(min(num_chars, len(text)))
        if token_id in skipped_ids:
            continue
        piece = decoder.decode(_token_bytes(token_id, vocabulary) or b"")
        if num_chars == 0:  # still at the start of the text
            num_stripped = min(num_to_strip, len(piece) - len(piece.lstrip(" ")))
            piece, num_to_strip = piece[num_stripped:], num_to_strip - num_stripped
        num_chars += len(piece)
    return offsets


def vllm_prompt_logprobs(prompt_token_ids: Sequence[int], entries: Sequence[dict[int, float] | None],
                         ranks: Sequence[int | None], vocabulary: TokenVocabulary | None) -> list:
    """vLLM's prompt_logprobs in JSON: per prompt position null (the first) or {token id:
    {"logprob", "rank", "decoded_token"}}, the prompt's token first, then the top tokens. rank: 1
    for the most likely token; the prompt token's is its rank in the whole vocabulary."""
    shown = []
    for token_id, entry, rank in zip(prompt_token_ids, entries, ranks):
        if entry is None:
            shown.append(None)
            continue
        position = {}
        for other_id, logprob in entry.items():
            other_rank = rank if other_id == token_id else 1 + sum(
                1 for t, lp in entry.items() if t != other_id and lp > logprob)
            position[str(other_id)] = {"logprob": _logprob(logprob), "rank": other_rank,
                                       "decoded_token": token_string(other_id, vocabulary)}
        shown.append(position)
    return shown


def echo_completion(prompt_text: str, prompt_token_ids: Sequence[int], prompt_entries: Sequence | None,
                    vocabulary: TokenVocabulary | None, text: str, logprobs: dict | None) -> tuple[str, dict | None]:
    """OpenAI's legacy completions with echo: the prompt's text before the completion's; with
    logprobs, the prompt tokens first (the first one's logprob and top_logprobs null, it has no
    context), their text_offset in the prompt's text, the completion's shifted after it."""
    if logprobs is None:
        return prompt_text + text, None
    prompt = {
        "tokens": [token_string(token_id, vocabulary) for token_id in prompt_token_ids],
        "token_logprobs": [None if entry is None else _logprob(entry[token_id])
                           for token_id, entry in zip(prompt_token_ids, prompt_entries)],
        "top_logprobs": [None if entry is None else _distinct_keys(token_id, entry, vocabulary)
                         for token_id, entry in zip(prompt_token_ids, prompt_entries)],
        "text_offset": text_offsets(prompt_token_ids, vocabulary, prompt_text),
    }
    shifted = [len(prompt_text) + offset for offset in logprobs["text_offset"]]
    return prompt_text + text, {key: prompt[key] + (shifted if key == "text_offset" else logprobs[key])
                                for key in prompt}


def _chat_token(token_id: int, entry: dict[int, float], num_top: int, vocabulary: TokenVocabulary | None) -> dict:
    # With num_top + 1 items, the sampled token is outside the top num_top: leave it out of the list.
    top = [(t, lp) for t, lp in _by_logprob(entry) if len(entry) <= num_top or t != token_id]
    return dict(_token_logprob(token_id, entry[token_id], vocabulary),
                top_logprobs=[_token_logprob(t, lp, vocabulary) for t, lp in top])


def _token_logprob(token_id: int, logprob: float, vocabulary: TokenVocabulary | None) -> dict:
    data = _token_bytes(token_id, vocabulary)
    return {"token": token_string(token_id, vocabulary), "logprob": _logprob(logprob),
            "bytes": None if data is None else list(data)}


def _distinct_keys(token_id: int, entry: dict[int, float], vocabulary: TokenVocabulary | None) -> dict[str, float]:
    """{token string: logprob}, sampled token first, then by logprob; a string already used
    becomes "token_id:N", so no entry overwrites another."""
    top: dict[str, float] = {}
    for other_id, logprob in [(token_id, entry[token_id]), *((t, lp) for t, lp in _by_logprob(entry) if t != token_id)]:
        key = token_string(other_id, vocabulary)
        top[f"token_id:{other_id}" if key in top else key] = _logprob(logprob)
    return dict(sorted(top.items(), key=lambda item: -item[1]))


def _token_bytes(token_id: int, vocabulary: TokenVocabulary | None) -> bytes | None:
    if vocabulary is None or not 0 <= token_id < len(vocabulary.token_bytes):
        return None
    return vocabulary.token_bytes[token_id]


def _logprob(value: float) -> float:
    return max(float(value), MIN_LOGPROB)


def _by_logprob(entry: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])
