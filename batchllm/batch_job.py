"""Run an OpenAI-Batch JSONL file through the engine and write one output line per request."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

from batchllm.engine.llm_engine import LLMEngine, PreparedRequest, RequestTooLongError, RunStats
from batchllm.io.batch_input import BatchError, BatchRequest, read_batch_file
from batchllm.io.batch_output import dumps, error_line, success_line
from batchllm.progress import Progress


@dataclass(frozen=True)
class BatchJobSummary:
    input_path: str
    output_path: str
    num_requests: int  # answered successfully
    num_errors: int  # lines that became error records
    num_prompt_tokens: int
    num_output_tokens: int
    num_steps: int
    seconds: float  # engine time (after loading and tokenizing)

    @property
    def requests_per_second(self) -> float:
        return self.num_requests / self.seconds if self.seconds else 0.0

    @property
    def output_tokens_per_second(self) -> float:
        return self.num_output_tokens / self.seconds if self.seconds else 0.0

    def describe(self) -> str:
        return (
            f"{self.num_requests} requests answered, {self.num_errors} errors -> {self.output_path}\n"
            f"{self.seconds:.2f} s: {self.requests_per_second:.2f} req/s, "
            f"{self.output_tokens_per_second:.1f} generated tok/s "
            f"({self.num_prompt_tokens} prompt tokens, {self.num_output_tokens} generated, {self.num_steps} steps)"
        )


def tokenize_request(engine: LLMEngine, request: BatchRequest) -> list[int]:
    if request.prompt_token_ids is not None:
        return list(request.prompt_token_ids)
    if engine.tokenizer is None:
        raise RequestTooLongError(f"model {engine.model_name} has no tokenizer: give prompt_token_ids")
    if request.messages is not None:
        return engine.tokenizer.encode_chat(request.messages)
    return engine.tokenizer.encode_prompt(request.prompt)


def run_batch_file(
    engine: LLMEngine,
    input_path: str,
    output_path: str,
    errors_path: str | None = None,
    show_progress: bool = True,
) -> BatchJobSummary:
    slots: list[dict | None] = []  # output line per input item, in input order
    prepared: list[PreparedRequest] = []
    requests: dict[int, BatchRequest] = {}
    for item in read_batch_file(input_path):
        if isinstance(item, BatchError):
            slots.append(error_line(item.custom_id, item.code, item.message, item.line_number))
            continue
        for warning in item.warnings:
            print(f"warning: line {item.line_number} ({item.custom_id}): {warning}", file=sys.stderr)
        try:
            token_ids = tokenize_request(engine, item)
            params = engine.check_length(token_ids, item.sampling)
        except (RequestTooLongError, ValueError) as error:
            slots.append(error_line(item.custom_id, "invalid_request", str(error), item.line_number))
            continue
        request_id = len(slots)
        slots.append(None)
        requests[request_id] = item
        prepared.append(PreparedRequest(request_id, token_ids, params))

    os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
    partial_path = output_path + ".partial"
    stats = RunStats()
    progress = Progress(len(prepared), enabled=show_progress)
    try:
        with open(partial_path, "w", encoding="utf-8") as partial:
            for done in engine.run(prepared, on_step=progress.update, stats=stats):
                request = requests[done.request_id]
                line = success_line(
                    request.custom_id, request.endpoint, request.model or engine.model_name, done.text,
                    done.finish_reason, len(done.prompt_token_ids), len(done.output_token_ids),
                    done.num_cached_prompt_tokens, _openai_logprobs(engine, done),
                )
                slots[done.request_id] = line
                partial.write(dumps(line) + "\n")
                partial.flush()
    finally:
        progress.close()

    # Final file in input order, written whole then renamed (never a torn output file).
    tmp_path = output_path + ".tmp"
    with open(tmp_path, "w", encoding="utf-8") as handle:
        for line in slots:
            handle.write(dumps(line) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp_path, output_path)
    os.remove(partial_path)
    errors = [line for line in slots if line["error"] is not None]
    if errors_path:
        with open(errors_path, "w", encoding="utf-8") as handle:
            for line in errors:
                handle.write(dumps(line) + "\n")
    return BatchJobSummary(input_path, output_path, len(prepared), len(errors), stats.num_prompt_tokens,
                           stats.num_output_tokens, stats.num_steps, stats.seconds)


def _openai_logprobs(engine: LLMEngine, done) -> dict | None:
    if done.logprobs is None or engine.tokenizer is None:
        return None
    decode = engine.tokenizer.decode
    content = []
    for token_id, entry in zip(done.output_token_ids, done.logprobs):
        top = [{"token": decode([t], skip_special_tokens=False), "logprob": lp} for t, lp in entry.items() if t != token_id]
        content.append({"token": decode([token_id], skip_special_tokens=False), "logprob": entry[token_id],
                        "top_logprobs": top})
    return {"content": content}
