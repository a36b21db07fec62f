"""Parse OpenAI-Batch JSONL input (and a short form) into requests or per-line errors.

Accepted line shapes:
  {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
   "body": {"model": "...", "messages": [...], "max_tokens": 64, "temperature": 0, ...}}
  {"custom_id": "r2", "method": "POST", "url": "/v1/completions", "body": {"prompt": "...", ...}}
  {"custom_id": "r3", "prompt" | "messages" | "prompt_token_ids": ..., <sampling fields>}   (short form)
A line that cannot be run becomes a BatchError; the job goes on (one error per bad line).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from batchllm.sampling_params import SamplingParams, SamplingParamsError

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
ENDPOINTS = {CHAT_URL: "chat", COMPLETIONS_URL: "completion"}
MAX_TOKEN_ID = (1 << 31) - 1  # token ids are held as int32

# Body fields we read; anything else is ignored with a warning.
_SAMPLING_FIELDS = {
    "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "n", "include_stop_str_in_output", "logit_bias",
}
_PROMPT_FIELDS = {"messages", "prompt", "prompt_token_ids"}
_HARMLESS_FIELDS = {"model", "user", "stream", "metadata", "store"}
_ENVELOPE_FIELDS = {"custom_id", "method", "url", "body"}


@dataclass(frozen=True)
class BatchRequest:
    custom_id: str
    line_number: int  # 1-based line in the input file (0 for Python-list input)
    endpoint: str  # "chat" | "completion"
    sampling: SamplingParams
    messages: tuple[dict, ...] | None = None
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    model: str | None = None
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class BatchError:
    line_number: int
    code: str  # "invalid_json" | "invalid_request" | "duplicate_custom_id" | ...
    message: str
    custom_id: str | None = None


class RequestError(ValueError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def parse_request_object(obj: object, line_number: int = 0) -> BatchRequest:
    """Turn one decoded JSON object into a BatchRequest, or raise RequestError."""
    if not isinstance(obj, dict):
        raise RequestError("invalid_request", "each line must be a JSON object")
    custom_id = obj.get("custom_id")
    if custom_id is None or (isinstance(custom_id, str) and not custom_id.strip()):
        raise RequestError("missing_custom_id", "missing custom_id (a non-empty string naming the request)")
    if not isinstance(custom_id, (str, int)) or isinstance(custom_id, bool):
        raise RequestError("invalid_custom_id", "custom_id must be a string")
    custom_id = str(custom_id)
    warnings: list[str] = []
    if "body" in obj or "url" in obj:
        method = obj.get("method", "POST")
        if method != "POST":
            raise RequestError("invalid_method", f"method must be POST, got {method!r}")
        url = obj.get("url")
        if not isinstance(url, str) or url not in ENDPOINTS:
            raise RequestError("invalid_url", f"url must be {CHAT_URL} or {COMPLETIONS_URL}, got {url!r}")
        body = obj.get("body")
        if not isinstance(body, dict):
            raise RequestError("missing_body", "missing body (a JSON object with the request)")
        endpoint = ENDPOINTS[url]
        warnings += [f"unknown field {k!r} ignored" for k in obj if k not in _ENVELOPE_FIELDS]
    else:
        body = obj
        endpoint = "chat" if "messages" in obj else "completion"
    known = _SAMPLING_FIELDS | _PROMPT_FIELDS | _HARMLESS_FIELDS | _ENVELOPE_FIELDS
    warnings += [f"unknown field {k!r} ignored" for k in body if k not in known]
    if body.get("stream"):
        warnings.append("stream=true ignored: batch results are written whole")
    messages, prompt, prompt_token_ids = _parse_prompt(body, endpoint)
    sampling = _parse_sampling(body, endpoint)
    model = body.get("model") if isinstance(body.get("model"), str) else None
    return BatchRequest(
        custom_id=custom_id,
        line_number=line_number,
        endpoint=endpoint,
        sampling=sampling,
        messages=messages,
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        model=model,
        warnings=tuple(warnings),
    )


def _parse_prompt(body: dict, endpoint: str):
    present = [k for k in ("messages", "prompt", "prompt_token_ids") if k in body]
    if not present:
        needed = "messages" if endpoint == "chat" else "prompt"
        raise RequestError("missing_prompt", f"missing {needed} (or prompt_token_ids)")
    if len(present) > 1:
        raise RequestError("invalid_request", f"give only one of {', '.join(present)}")
    key = present[0]
    value = body[key]
    if key == "messages":
        if endpoint != "chat":
            raise RequestError("invalid_request", "messages needs url /v1/chat/completions")
        return _parse_messages(value), None, None
    if key == "prompt" and isinstance(value, str):
        if endpoint == "chat":
            raise RequestError("invalid_request", "the chat endpoint takes messages, not prompt")
        if not value:
            raise RequestError("empty_prompt", "prompt is empty")
        return None, value, None
    # prompt_token_ids, or an OpenAI-style token array in prompt
    if key == "prompt" and isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        raise RequestError("invalid_request", "one prompt per line: prompt must be a string, not a list of strings")
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise RequestError("invalid_request", f"{key} must be a string or a list of token ids")
    if not value:
        raise RequestError("empty_prompt", f"{key} is empty")
    if any(t < 0 or t > MAX_TOKEN_ID for t in value):
        bad = next(t for t in value if t < 0 or t > MAX_TOKEN_ID)
        raise RequestError("invalid_request", f"{key} holds token id {bad}, outside [0, {MAX_TOKEN_ID}]")
    return None, None, tuple(value)


def _parse_messages(value: object) -> tuple[dict, ...]:
    if not isinstance(value, list) or not value:
        raise RequestError("empty_prompt" if value == [] else "invalid_request", "messages must be a non-empty list")
    messages = []
    for index, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError("invalid_request", f"messages[{index}] needs a string role")
        content = message.get("content")
        if isinstance(content, list):  # OpenAI content parts: keep the text parts
            texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                raise RequestError("invalid_request", f"messages[{index}]: only text content parts are supported")
            content = "".join(texts)
        if not isinstance(content, str):
            raise RequestError("invalid_request", f"messages[{index}] needs string content")
        messages.append({"role": message["role"], "content": content})
    if not any(m["content"] for m in messages):
        raise RequestError("empty_prompt", "every message is empty")
    return tuple(messages)


def _parse_sampling(body: dict, endpoint: str) -> SamplingParams:
    kwargs: dict = {}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    elif endpoint == "chat":
        kwargs["max_tokens"] = None  # OpenAI chat: up to the context length
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "n", "include_stop_str_in_output", "logit_bias"):
        if body.get(name) is not None:
            kwargs[name] = body[name]
    if body.get("ignore_eos") is not None:
        kwargs["ignore_eos"] = bool(body["ignore_eos"])
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list):
            raise RequestError("invalid_sampling", "stop must be a string or a list of strings")
        kwargs["stop"] = tuple(stop)
    if body.get("stop_token_ids") is not None:
        ids = body["stop_token_ids"]
        if not isinstance(ids, list):
            raise RequestError("invalid_sampling", "stop_token_ids must be a list of integers")
        kwargs["stop_token_ids"] = tuple(ids)
    logprobs = body.get("logprobs")
    if endpoint == "chat":
        if logprobs:
            kwargs["logprobs"] = body.get("top_logprobs") or 0
    elif logprobs is not None and logprobs is not False:
        kwargs["logprobs"] = logprobs
    try:
        return SamplingParams(**kwargs)
    except SamplingParamsError as error:
        raise RequestError("invalid_sampling", str(error)) from None
    except TypeError as error:
        raise RequestError("invalid_sampling", str(error)) from None


def parse_lines(lines: Iterable[bytes | str], start_line: int = 1) -> Iterator[BatchRequest | BatchError]:
    """Parse JSONL lines; blank lines are skipped; duplicate custom_ids are errors."""
    seen: set[str] = set()
    for line_number, raw in enumerate(lines, start=start_line):
        if isinstance(raw, bytes):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield BatchError(line_number, "invalid_utf8", f"line is not valid UTF-8 ({error.reason} at byte {error.start})")
                continue
        else:
            text = raw
        if not text.strip(" \t\r\n"):  # JSON whitespace only: a line of other control bytes is an error
            continue
        try:
            obj = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as error:
            yield BatchError(line_number, "invalid_json", f"invalid JSON: {error}")
            continue
        custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
        custom_id = str(custom_id) if isinstance(custom_id, (str, int)) and not isinstance(custom_id, bool) else None
        if "\\u" in text and _has_lone_surrogate(obj):
            # JSON escapes such as "\ud800" decode to text that cannot be written as UTF-8.
            yield BatchError(line_number, "invalid_unicode", "line holds a lone UTF-16 surrogate escape "
                             "(e.g. \\ud800): not valid Unicode", None if _has_lone_surrogate(custom_id) else custom_id)
            continue
        try:
            request = parse_request_object(obj, line_number)
        except RequestError as error:
            yield BatchError(line_number, error.code, str(error), custom_id)
            continue
        if request.custom_id in seen:
            yield BatchError(line_number, "duplicate_custom_id",
                             f"custom_id {request.custom_id!r} already used on an earlier line", request.custom_id)
            continue
        seen.add(request.custom_id)
        yield request


def _has_lone_surrogate(value: object) -> bool:
    """True if any string (key or value) inside value cannot be encoded as UTF-8."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def read_batch_file(path: str) -> Iterator[BatchRequest | BatchError]:
    """Stream a JSONL file (bytes, so invalid UTF-8 on one line stays that line's error)."""
    with open(path, "rb") as handle:
        yield from parse_lines(line.rstrip(b"\r\n") for line in handle)
