"""Build OpenAI-Batch output lines (torch-free)."""

from __future__ import annotations

import json
import time
import uuid


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
    created: int | None = None,
) -> dict:
    created = int(time.time()) if created is None else created
    request_id = f"req_{uuid.uuid4().hex[:24]}"
    usage = {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_prompt_tokens},
    }
    if endpoint == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": logprobs, "finish_reason": finish_reason}
        body = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": created,
                "model": model_name, "choices": [choice], "usage": usage}
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        body = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": created,
                "model": model_name, "choices": [choice], "usage": usage}
    return {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}


def error_line(custom_id: str | None, code: str, message: str, line_number: int | None = None) -> dict:
    error = {"code": code, "message": message}
    if line_number is not None:
        error["line"] = line_number
    return {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": custom_id, "response": None, "error": error}


def dumps(record: dict) -> str:
    return json.dumps(record, ensure_ascii=False)
