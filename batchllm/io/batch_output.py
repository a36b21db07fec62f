"""Build OpenAI-Batch output lines (torch-free)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence


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
) -> dict:
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
    response = {"status_code": 200, "request_id": f"req_{uuid.uuid4().hex[:24]}", "body": body}
    return {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": custom_id, "response": response,
            "error": None}


def error_line(custom_id: str | None, code: str, message: str, line_number: int) -> dict:
    error = {"code": code, "message": message, "line": line_number}
    return {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": custom_id, "response": None, "error": error}


def dumps(record: dict) -> str:
    return json.dumps(record, ensure_ascii=False)


def openai_logprobs(
    endpoint: str,
    token_ids: Sequence[int],
    entries: Sequence[dict[int, float]],
    num_top: int,
    decode_token: Callable[[int], str],
) -> dict:
    """The `logprobs` of a choice, in the endpoint's OpenAI shape.

    entries: per generated token, {token_id: logprob} holding the sampled token and the
    position's num_top most likely tokens (num_top or num_top + 1 items).
    chat:       {"content": [{token, logprob, bytes, top_logprobs: [num_top x {token, logprob, bytes}]}]}
                top_logprobs is the position's top num_top, whether or not the sampled token is in it.
    completion: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}
                each top_logprobs dict holds the top num_top plus the sampled token (so up to
                num_top + 1 keys, as OpenAI documents); text_offset counts characters from the
                start of the completion text.
    """
    if endpoint == "chat":
        return {"content": [_chat_token(token_id, entry, num_top, decode_token)
                            for token_id, entry in zip(token_ids, entries)]}
    tokens = [decode_token(token_id) for token_id in token_ids]
    offsets, offset = [], 0
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [entry[token_id] for token_id, entry in zip(token_ids, entries)],
        "top_logprobs": [{decode_token(t): lp for t, lp in _by_logprob(entry)} for entry in entries],
        "text_offset": offsets,
    }


def _chat_token(token_id: int, entry: dict[int, float], num_top: int, decode_token: Callable[[int], str]) -> dict:
    # With num_top + 1 items, the sampled token is outside the top num_top: leave it out of the list.
    top = [(t, lp) for t, lp in _by_logprob(entry) if len(entry) <= num_top or t != token_id]
    return dict(_token_logprob(token_id, entry[token_id], decode_token),
                top_logprobs=[_token_logprob(t, lp, decode_token) for t, lp in top])


def _token_logprob(token_id: int, logprob: float, decode_token: Callable[[int], str]) -> dict:
    text = decode_token(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _by_logprob(entry: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])
