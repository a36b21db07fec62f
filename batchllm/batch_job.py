"""Run an OpenAI-Batch JSONL file through the engine and write one output line per request.

Streaming and crash-safe (issue 7):
  read a line -> parse -> tokenize (int32 array) -> window of `window_num_requests` requests
  -> engine.run -> each finished request is appended to the journal OUTPUT.partial at once
  -> at the end the output file is written from the journal (input or finish order), renamed
  atomically, and the journal removed. See batchllm/io/journal.py for the journal format.
Running the same job again after a crash resumes: lines already in the journal are skipped.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, replace

import numpy as np

from batchllm.engine.llm_engine import LLMEngine, PreparedRequest, RequestTooLongError, RunStats
from batchllm.io.batch_input import BatchError, BatchRequest, read_batch_file
from batchllm.io.batch_output import dumps, error_line, openai_logprobs, success_line
from batchllm.io.journal import Journal, JournalHeader
from batchllm.progress import Progress

ORDERS = ("input", "finish")


@dataclass(frozen=True)
class BatchJobOptions:
    errors_path: str | None = None  # also write the error records here
    order: str = "input"  # final output order: "input" (rewrite at the end) or "finish"
    window_num_requests: int | None = None  # plan and run this many requests at a time (None: all)
    restart: bool = False  # ignore an existing journal
    show_progress: bool = True
    max_printed_warnings: int = 20  # per-line warnings printed; the rest are counted

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        if self.window_num_requests is not None and self.window_num_requests < 1:
            raise ValueError(f"window must be >= 1 requests, got {self.window_num_requests}")


@dataclass
class StopRequest:
    """Set by a signal handler (SIGINT/SIGTERM); the job stops after the current step."""

    signal_name: str | None = None
    exit_code: int = 0

    @property
    def requested(self) -> bool:
        return self.signal_name is not None


class JobInterrupted(Exception):
    pass


@dataclass(frozen=True)
class BatchJobSummary:
    input_path: str
    output_path: str
    num_requests: int  # answered successfully (including ones resumed from the journal)
    num_errors: int  # lines that became error records
    num_prompt_tokens: int  # of this run's requests
    num_output_tokens: int
    num_steps: int
    seconds: float  # engine time (after loading and tokenizing)
    num_resumed: int = 0  # records taken from an earlier run's journal
    journal_path: str = ""
    interrupted_by: str | None = None  # signal name when stopped early (no final output yet)

    @property
    def requests_per_second(self) -> float:
        return self.num_requests / self.seconds if self.seconds else 0.0

    @property
    def output_tokens_per_second(self) -> float:
        return self.num_output_tokens / self.seconds if self.seconds else 0.0

    def describe(self) -> str:
        if self.interrupted_by:
            return (f"interrupted by {self.interrupted_by}: {self.num_requests} requests answered and "
                    f"{self.num_errors} errors are saved in {self.journal_path}.\n"
                    f"Run the same command again to resume (add --restart to start over).")
        resumed = f" ({self.num_resumed} resumed from an earlier run)" if self.num_resumed else ""
        return (
            f"{self.num_requests} requests answered, {self.num_errors} errors -> {self.output_path}{resumed}\n"
            f"{self.seconds:.2f} s: {self.requests_per_second:.2f} req/s, "
            f"{self.output_tokens_per_second:.1f} generated tok/s "
            f"({self.num_prompt_tokens} prompt tokens, {self.num_output_tokens} generated, {self.num_steps} steps)"
        )


@dataclass
class _Pending:
    """One window's runnable requests: compact token ids + what the output line needs."""

    line_numbers: list[int] = field(default_factory=list)
    requests: list[BatchRequest] = field(default_factory=list)
    token_ids: list[np.ndarray] = field(default_factory=list)  # int32 per request
    params: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.line_numbers)


def tokenize_request(engine: LLMEngine, request: BatchRequest) -> list[int]:
    if request.prompt_token_ids is not None:
        return list(request.prompt_token_ids)
    if engine.tokenizer is None:
        raise RequestTooLongError(f"model {engine.model_name} has no tokenizer: give prompt_token_ids")
    if request.messages is not None:
        return engine.tokenizer.encode_chat(request.messages)
    return engine.tokenizer.encode_prompt(request.prompt)


def prepare_request(engine: LLMEngine, request: BatchRequest):
    """(int32 token ids, checked params) or an error record (prompt too long, no tokenizer, ...)."""
    try:
        token_ids = tokenize_request(engine, request)
    except RequestTooLongError as error:
        return error_line(request.custom_id, "invalid_request", str(error), request.line_number)
    except Exception as error:  # a tokenizer or chat template failing on one line's content
        return error_line(request.custom_id, "tokenization_failed", f"{type(error).__name__}: {error}",
                          request.line_number)
    limit = engine.token_limit
    if len(token_ids) >= limit:
        return error_line(request.custom_id, "prompt_too_long",
                          f"prompt has {len(token_ids)} tokens; the limit is {limit - 1} (max model length "
                          f"{engine.max_model_len}, KV cache {engine.num_kv_tokens} tokens): shorten the prompt",
                          request.line_number)
    try:
        params = engine.check_length(token_ids, request.sampling)  # clamps max_tokens (README)
    except (RequestTooLongError, ValueError) as error:
        return error_line(request.custom_id, "invalid_request", str(error), request.line_number)
    return np.asarray(token_ids, dtype=np.int32), params


def count_lines(path: str, chunk_num_bytes: int = 1 << 20) -> int:
    num_lines, last = 0, b"\n"
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_num_bytes):
            num_lines += chunk.count(b"\n")
            last = chunk[-1:]
    return num_lines + (last != b"\n")


def run_batch_file(
    engine: LLMEngine,
    input_path: str,
    output_path: str,
    errors_path: str | None = None,
    show_progress: bool = True,
    options: BatchJobOptions | None = None,
    stop: StopRequest | None = None,
) -> BatchJobSummary:
    options = options or BatchJobOptions(errors_path=errors_path, show_progress=show_progress)
    stop = stop or StopRequest()
    os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
    header = JournalHeader(os.path.getsize(input_path), engine.model_name)
    journal = Journal(output_path + ".partial", header, restart=options.restart)
    if journal.resume.num_entries or journal.resume.num_torn_bytes:
        print(f"resuming from {journal.path}: {journal.resume.num_entries} records kept"
              + (f", a torn last line ({journal.resume.num_torn_bytes} bytes) dropped" if journal.resume.num_torn_bytes
                 else "")
              + (f", {journal.resume.num_corrupt_lines} corrupt lines dropped" if journal.resume.num_corrupt_lines
                 else ""), file=sys.stderr)
    run = _JobRun(engine, journal, options, stop, count_lines(input_path))
    try:
        run.stream(input_path)
    except JobInterrupted:
        pass
    except BaseException:
        journal.close()
        print(f"error: the job stopped early; {journal.num_entries} records are saved in {journal.path}: "
              "run the same command again to resume", file=sys.stderr)
        raise
    finally:
        run.progress.close()
    num_errors = journal.num_errors
    if stop.requested:
        journal.close()
    else:
        journal.finalize(output_path, options.order, options.errors_path)
    if run.num_warnings > options.max_printed_warnings:
        print(f"warning: {run.num_warnings - options.max_printed_warnings} more warnings not shown", file=sys.stderr)
    stats = run.stats
    return BatchJobSummary(input_path, output_path, journal.num_entries - num_errors, num_errors,
                           stats.num_prompt_tokens, stats.num_output_tokens, stats.num_steps, stats.seconds,
                           journal.resume.num_entries, journal.path, stop.signal_name)


class _JobRun:
    """The streaming loop of one job: parse -> window -> engine -> journal."""

    def __init__(self, engine: LLMEngine, journal: Journal, options: BatchJobOptions, stop: StopRequest,
                 num_lines: int) -> None:
        self.engine, self.journal, self.options, self.stop = engine, journal, options, stop
        self.stats = RunStats()
        self.num_warnings = 0
        self.progress = Progress(num_lines, enabled=options.show_progress, description="lines")
        self.progress.update(journal.num_entries, 0)

    def stream(self, input_path: str) -> None:
        pending = _Pending()
        for item in read_batch_file(input_path):
            if self.stop.requested:
                raise JobInterrupted
            if (item.line_number, item.custom_id) in self.journal.done:
                continue
            if isinstance(item, BatchError):
                self._write(item.line_number, error_line(item.custom_id, item.code, item.message, item.line_number))
                continue
            self._warn(item)
            prepared = prepare_request(self.engine, item)
            if isinstance(prepared, dict):
                self._write(item.line_number, prepared)
                continue
            pending.line_numbers.append(item.line_number)
            pending.requests.append(_strip_prompt(item))
            pending.token_ids.append(prepared[0])
            pending.params.append(prepared[1])
            if len(pending) == self.options.window_num_requests:
                self._run_window(pending)
                pending = _Pending()
        if len(pending):
            self._run_window(pending)

    def _run_window(self, pending: _Pending) -> None:
        prepared = [PreparedRequest(line, ids.tolist(), params)
                    for line, ids, params in zip(pending.line_numbers, pending.token_ids, pending.params)]
        pending.token_ids.clear()
        requests = dict(zip(pending.line_numbers, pending.requests))
        for done in self.engine.run(prepared, on_step=self._on_step, stats=self.stats):
            request = requests.pop(done.request_id)
            if done.error is not None:
                line = error_line(request.custom_id, "invalid_request", done.error, done.request_id)
            else:
                line = success_line(
                    request.custom_id, request.endpoint, request.model or self.engine.model_name, done.text,
                    done.finish_reason, len(done.prompt_token_ids), len(done.output_token_ids),
                    done.num_cached_prompt_tokens, _openai_logprobs(self.engine, done, request),
                )
            self.journal.append(done.request_id, line, dumps(line))
        self.journal.sync()

    def _on_step(self, num_finished: int, num_new_tokens: int) -> None:
        self.progress.update(num_finished, num_new_tokens)
        self.journal.maybe_sync()
        if self.stop.requested:
            raise JobInterrupted

    def _write(self, line_number: int, record: dict) -> None:
        self.journal.append(line_number, record, dumps(record))
        self.progress.update(1, 0)

    def _warn(self, item: BatchRequest) -> None:
        for warning in item.warnings:
            self.num_warnings += 1
            if self.num_warnings <= self.options.max_printed_warnings:
                print(f"warning: line {item.line_number} ({item.custom_id}): {warning}", file=sys.stderr)


def _strip_prompt(request: BatchRequest) -> BatchRequest:
    """Keep only what the output line needs (the prompt is held as int32 token ids)."""
    return replace(request, messages=None, prompt=None, prompt_token_ids=None, warnings=())


def _openai_logprobs(engine: LLMEngine, done, request: BatchRequest) -> dict | None:
    if done.logprobs is None or engine.tokenizer is None:
        return None
    decode = engine.tokenizer.decode
    return openai_logprobs(request.endpoint, done.output_token_ids, done.logprobs, request.sampling.logprobs,
                           lambda token_id: decode([token_id], skip_special_tokens=False))
