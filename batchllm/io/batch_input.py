"""Parse OpenAI-Batch JSONL input (and a short form) into requests or per-line errors.

Accepted line shapes:
  {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
   "body": {"model": "...", "messages": [...], "max_tokens": 64, "temperature": 0, ...}}
  {"custom_id": "r2", "method": "POST", "url": "/v1/completions", "body": {"prompt": "...", ...}}
  {"custom_id": "r3", "prompt" | "messages" | "prompt_token_ids": ..., <sampling fields>}   (short form)
A line that cannot be run becomes a BatchError; the job goes on (one error per bad line).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from batchllm.io.compact_set import Int64Set, digest64
from batchllm.io.output_check import DUPLICATE_CODE
from batchllm.io.request_fields import FieldWarning, check_fields
from batchllm.io.structured_fields import StructuredFieldError, parse_structured_outputs
from batchllm.sampling_params import SamplingParams, SamplingParamsError, short_repr

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
ENDPOINTS = {CHAT_URL: "chat", COMPLETIONS_URL: "completion"}
MAX_TOKEN_ID = (1 << 31) - 1  # token ids are held as int32
MAX_INT64 = (1 << 63) - 1
DEFAULT_MAX_LINE_BYTES = 10 << 20  # 10 MiB: ~100x the text of a 128k-token context
UTF8_BOM = b"\xef\xbb\xbf"
_READ_CHUNK_BYTES = 1 << 20

_ENVELOPE_FIELDS = {"custom_id", "method", "url", "body"}
_ENVELOPE_REASON = "not a field of an OpenAI Batch line (custom_id, method, url, body)"


@dataclass(frozen=True)
class BatchRequest:
    custom_id: str
    line_number: int  # 1-based line in the input file (0 for Python-list input)
    endpoint: str  # "chat" | "completion"
    sampling: SamplingParams
    messages: tuple[dict, ...] | None = None
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    warnings: tuple[FieldWarning, ...] = ()  # fields accepted without effect (counted by the job)
    digest: int = 0  # digest64 of the raw input line (the journal checks it on resume)
    echo: bool = False  # /v1/completions: the prompt's text (and logprobs) before the completion's
    # vLLM's return_token_ids: the answer carries the prompt's and each choice's token ids.
    # None: not set, which means on for a model without a tokenizer (its text is empty).
    return_token_ids: bool | None = None


@dataclass(frozen=True)
class BatchError:
    line_number: int
    code: str  # "invalid_json" | "invalid_request" | "duplicate_custom_id" | ...
    message: str
    custom_id: str | None = None
    digest: int = 0


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
    warnings: list[FieldWarning] = []
    if "body" in obj or "url" in obj:
        method = obj.get("method", "POST")
        if method != "POST":
            raise RequestError("invalid_method", f"method must be POST, got {short_repr(method)}")
        url = obj.get("url")
        if not isinstance(url, str) or url not in ENDPOINTS:
            raise RequestError("invalid_url", f"url must be {CHAT_URL} or {COMPLETIONS_URL}, got {short_repr(url)}")
        body = obj.get("body")
        if not isinstance(body, dict):
            raise RequestError("missing_body", "missing body (a JSON object with the request)")
        endpoint = ENDPOINTS[url]
        # The line around the body names no request setting: an unknown key there is a warning.
        warnings += [FieldWarning(k, _ENVELOPE_REASON) for k in obj if k not in _ENVELOPE_FIELDS]
    else:
        body = {k: v for k, v in obj.items() if k != "custom_id"}
        endpoint = "chat" if "messages" in obj else "completion"
    refusal, field_warnings = check_fields(body, endpoint)
    if refusal is not None:
        raise RequestError(refusal.code, refusal.message)
    warnings += field_warnings
    messages, prompt, prompt_token_ids = _parse_prompt(body, endpoint)
    echo = body.get("echo") is not None and _boolean(body["echo"], "echo")
    if echo and endpoint == "chat":
        raise RequestError("unsupported_feature", "echo=true is supported on /v1/completions only: remove 'echo' "
                           "from the chat request")
    sampling = _parse_sampling(body, endpoint, echo)
    return_token_ids = body.get("return_token_ids")
    if return_token_ids is not None:
        return_token_ids = _boolean(return_token_ids, "return_token_ids")
    return BatchRequest(custom_id, line_number, endpoint, sampling, messages=messages, prompt=prompt,
                        prompt_token_ids=prompt_token_ids, warnings=tuple(warnings), echo=echo,
                        return_token_ids=return_token_ids)


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
    bad = next((t for t in value if t < 0 or t > MAX_TOKEN_ID), None)
    if bad is not None:
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


def _integer(value: object, name: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise RequestError("invalid_sampling", f"{name} must be an integer in [{low}, {high}], got {short_repr(value)}")
    return value


def _boolean(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise RequestError("invalid_sampling", f"{name} must be true or false, got {short_repr(value)}")
    return value


def _parse_sampling(body: dict, endpoint: str, echo: bool = False) -> SamplingParams:
    """Check each field's JSON type here (bool is not an int, sizes fit int32/int64); value
    ranges are SamplingParams' to check. echo with logprobs asks for the prompt's logprobs too
    (with as many top tokens, unless prompt_logprobs says otherwise), as vLLM does."""
    kwargs: dict = {}
    max_tokens = next((body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), None)
    if max_tokens is not None:
        kwargs["max_tokens"] = _integer(max_tokens, "max_tokens", -MAX_TOKEN_ID, MAX_TOKEN_ID)
    elif endpoint == "chat":
        kwargs["max_tokens"] = None  # OpenAI chat: up to the context length
    for name in ("temperature", "top_p", "min_p", "logit_bias", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        if body.get(name) is not None:
            kwargs[name] = body[name]
    for name, low, high in (("top_k", -MAX_TOKEN_ID, MAX_TOKEN_ID), ("seed", -MAX_INT64 - 1, MAX_INT64),
                            ("n", -MAX_TOKEN_ID, MAX_TOKEN_ID), ("min_tokens", -MAX_TOKEN_ID, MAX_TOKEN_ID)):
        if body.get(name) is not None:
            kwargs[name] = _integer(body[name], name, low, high)
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        if body.get(name) is not None:
            kwargs[name] = _boolean(body[name], name)
    stop = body.get("stop")
    if stop is not None:
        if not isinstance(stop, (str, list)):
            raise RequestError("invalid_sampling", "stop must be a string or a list of strings")
        kwargs["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
    if body.get("stop_token_ids") is not None:
        ids = body["stop_token_ids"]
        if not isinstance(ids, list):
            raise RequestError("invalid_sampling", "stop_token_ids must be a list of integers")
        kwargs["stop_token_ids"] = tuple(_integer(t, "each stop_token_ids entry", 0, MAX_TOKEN_ID) for t in ids)
    logprobs = _parse_logprobs(body, endpoint)
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    if body.get("prompt_logprobs") is not None:
        kwargs["prompt_logprobs"] = _integer(body["prompt_logprobs"], "prompt_logprobs", -MAX_TOKEN_ID, MAX_TOKEN_ID)
    elif echo and logprobs is not None:
        kwargs["prompt_logprobs"] = logprobs
    try:
        structured = parse_structured_outputs(body)
    except StructuredFieldError as error:
        raise RequestError(error.code, str(error)) from None
    if structured is not None:
        kwargs["structured_outputs"] = structured
    try:
        sampling = SamplingParams(**kwargs)
    except (SamplingParamsError, TypeError) as error:
        raise RequestError("invalid_sampling", str(error)) from None
    _check_best_of(body.get("best_of"), sampling.n)
    return sampling


def _check_best_of(best_of: object, n: int) -> None:
    """best_of picks the n best of best_of samples; batchllm returns every sample it draws, so
    only best_of = n (or unset) asks for what it does."""
    if best_of is None:
        return
    best_of = _integer(best_of, "best_of", 1, MAX_TOKEN_ID)
    if best_of != n:
        raise RequestError("unsupported_feature", f"best_of={best_of} with n={n} is not supported: every sample is "
                           f"returned, so set best_of to n ({n}) or remove it")


def _parse_logprobs(body: dict, endpoint: str) -> int | None:
    """Number of top logprobs per token, or None. Chat: logprobs true/false + top_logprobs
    0..20; completions: logprobs 0..20 (OpenAI's legacy integer form)."""
    logprobs, top_logprobs = body.get("logprobs"), body.get("top_logprobs")
    if endpoint == "chat":
        wanted = logprobs is not None and _boolean(logprobs, "logprobs")
        if top_logprobs is None:
            return 0 if wanted else None
        top_logprobs = _integer(top_logprobs, "top_logprobs", 0, 20)
        if not wanted:
            raise RequestError("invalid_sampling", "top_logprobs needs logprobs: true")
        return top_logprobs
    if logprobs is None or logprobs is False:
        return None
    return _integer(logprobs, "logprobs (on /v1/completions: the number of top tokens)", 0, 20)


def parse_line(raw: bytes | str, line_number: int, digest: int = 0) -> BatchRequest | BatchError | None:
    """One line -> a request, an error, or None (blank). Whether its custom_id is a duplicate is
    decided over the whole input (first_line_wins), not here."""
    try:
        return _parse_line(raw, line_number, digest)
    except Exception as error:  # a parser bug must cost one line, not the job
        return BatchError(line_number, "internal_error", f"{type(error).__name__}: {error}", None, digest)


def _parse_line(raw: bytes | str, line_number: int, digest: int) -> BatchRequest | BatchError | None:
    if isinstance(raw, bytes):
        if line_number == 1 and raw.startswith(UTF8_BOM):
            raw = raw[len(UTF8_BOM):]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            return BatchError(line_number, "invalid_utf8",
                              f"line is not valid UTF-8 ({error.reason} at byte {error.start})", None, digest)
    else:
        text = raw.removeprefix("\ufeff") if line_number == 1 else raw
    if not text.strip(" \t\r\n"):  # JSON whitespace only: a line of other control bytes is an error
        return None
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as error:
        return BatchError(line_number, "invalid_json", f"invalid JSON: {error}", None, digest)
    except ValueError:  # an integer past Python's int-string conversion limit
        return BatchError(line_number, "invalid_json", f"the line holds an integer of more than "
                          f"{sys.get_int_max_str_digits()} digits, which no field takes: shorten it", None, digest)
    custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
    custom_id = str(custom_id) if isinstance(custom_id, (str, int)) and not isinstance(custom_id, bool) else None
    if "\\u" in text and _has_lone_surrogate(obj):
        # JSON escapes such as "\ud800" decode to text that cannot be written as UTF-8.
        return BatchError(line_number, "invalid_unicode", "line holds a lone UTF-16 surrogate escape "
                          "(e.g. \\ud800): not valid Unicode", None if _has_lone_surrogate(custom_id) else custom_id,
                          digest)
    try:
        request = parse_request_object(obj, line_number)
    except RequestError as error:
        return BatchError(line_number, error.code, str(error), custom_id, digest)
    return request if not digest else dataclasses.replace(request, digest=digest)


def _has_lone_surrogate(value: object) -> bool:
    """True if any string (key or value) inside value cannot be encoded as UTF-8."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


@dataclass(frozen=True)
class RawLine:
    line_number: int  # 1-based
    data: bytes | None  # without the line end; None when longer than max_line_bytes
    digest: int  # digest64 of the line as stored (line end included)
    num_bytes: int


def read_lines(path: str, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> Iterator[RawLine]:
    """Stream a file's lines, never holding more than max_line_bytes + 1 MiB of one line: a
    longer line is hashed chunk by chunk, skipped to its newline and given as data=None."""
    with open(path, "rb") as handle:
        line_number = 0
        while raw := handle.readline(max_line_bytes + 2):  # + 2: the line end "\r\n"
            line_number += 1
            if raw.endswith(b"\n") or len(raw) <= max_line_bytes:
                data = raw.rstrip(b"\r\n")
                yield RawLine(line_number, data if len(data) <= max_line_bytes else None, digest64(raw), len(raw))
                continue
            hasher, num_bytes = hashlib.blake2b(raw, digest_size=8), len(raw)
            while not raw.endswith(b"\n") and (raw := handle.readline(_READ_CHUNK_BYTES)):
                hasher.update(raw)
                num_bytes += len(raw)
            yield RawLine(line_number, None, int.from_bytes(hasher.digest(), "little", signed=True), num_bytes)


def read_batch_file(path: str, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> Iterator[BatchRequest | BatchError]:
    """Stream a JSONL file (bytes, so invalid UTF-8 on one line stays that line's error); each
    item carries its line's digest. A line over max_line_bytes is a line_too_long error, unparsed.
    custom_ids are unique across the file (first_line_wins)."""
    return first_line_wins(_read_items(path, max_line_bytes))


def _read_items(path: str, max_line_bytes: int) -> Iterator[BatchRequest | BatchError]:
    for line in read_lines(path, max_line_bytes):
        if line.data is None:
            yield BatchError(line.line_number, "line_too_long",
                             f"line has {line.num_bytes} bytes, over the limit of {max_line_bytes} "
                             "(shorten the prompt, or raise --max-line-bytes)", None, line.digest)
            continue
        item = parse_line(line.data, line.line_number, line.digest)
        if item is not None:
            yield item


def first_line_wins(items: Iterable[BatchRequest | BatchError]) -> Iterator[BatchRequest | BatchError]:
    """custom_ids are unique across the whole input, valid lines or not: the first line with an id
    stands (answered, or its own error), and every later line with that id becomes a
    duplicate_custom_id error. Decided again from the input on every run, so a resume after an
    edit never keeps an answer for a line that is now a duplicate, nor a duplicate error for a line
    that is now unique. Memory: a 64-bit digest per id (compact_set.Int64Set)."""
    seen = Int64Set()
    for item in items:
        custom_id = item.custom_id
        if isinstance(custom_id, str) and custom_id.strip():
            first = seen.add(digest64(custom_id.encode("utf-8", "surrogatepass")))
            if not first and not (isinstance(item, BatchError) and item.code == DUPLICATE_CODE):
                item = BatchError(item.line_number, DUPLICATE_CODE,
                                  f"custom_id {custom_id!r} already used on an earlier line", custom_id, item.digest)
        yield item
