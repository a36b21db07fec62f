"""Run an OpenAI-Batch JSONL file through the engine, streaming and crash-safe: one output line
per request, journaled as it finishes (docs/design.md, "Crash-safe jobs").
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from batchllm.engine.errors import EngineBrokenError
from batchllm.engine.llm_engine import FinishedOutput, LLMEngine, PreparedRequest, RunStats
from batchllm.engine.samples import SampleSplit
from batchllm.io.batch_input import DEFAULT_MAX_LINE_BYTES, BatchError, BatchRequest, read_batch_file
from batchllm.io.batch_output import (choice, dumps, echo_completion, error_line, openai_logprobs, success_line,
                                      vllm_prompt_logprobs)
from batchllm.io.request_fields import FieldWarning
from batchllm.io.job_files import JobLock, check_existing_output, check_job_paths, journal_path_for
from batchllm.io.job_io import JobFileError, file_operation
from batchllm.io.journal import Journal, JournalMismatchError, ResumeReport
from batchllm.io.output_check import OutputCheckError
from batchllm.job.job_identity import check_engine_settings, engine_settings, held_limits, job_header
from batchllm.job.progress import Progress
from batchllm.engine.request_limits import (EmptyPromptError, InvalidRequestError, NoTokenizerError, PromptTooLongError,
                                            RequestLimits, token_id_array)
from batchllm.sampling_params import SamplingParams
from batchllm.structured.errors import StructuredOutputError

ORDERS = ("input", "finish")
# errors whose one-line message already says how to go on (the CLI prints it)
_SAYS_HOW_TO_GO_ON = (JournalMismatchError, JobFileError, OutputCheckError)
_ERROR_CODES = {PromptTooLongError: "prompt_too_long", EmptyPromptError: "empty_prompt"}
# A request of the window being filled: what its output line needs, its prompt as int32 token ids
# (4 bytes a token until the window runs) and its checked sampling parameters.
_Runnable = tuple[BatchRequest, np.ndarray, SamplingParams]


@dataclass(frozen=True)
class BatchJobOptions:
    errors_path: str | None = None  # also write the error records here
    order: str = "input"  # final output order: "input" (rewrite at the end) or "finish"
    # plan and run this many requests at a time (None: all); a line of n samples counts n and is never split
    window_num_requests: int | None = None
    restart: bool = False  # ignore an existing journal
    overwrite: bool = False  # replace an existing output file (else refused, unless resuming its job)
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES  # a longer input line is a line_too_long record
    show_progress: bool = True
    max_printed_warnings: int = 20  # internal errors printed as they happen; the rest are counted
    chat_template: str | None = None  # Jinja text that renders chat lines (None: the model's template)

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        if self.window_num_requests is not None and self.window_num_requests < 1:
            raise ValueError(f"window must be >= 1 requests, got {self.window_num_requests}")
        if self.max_line_bytes < 1:
            raise ValueError(f"max line bytes must be >= 1, got {self.max_line_bytes}")


@dataclass
class StopRequest:
    """Set on SIGINT/SIGTERM (batchllm.job.stop_signals); the job stops after the current step.
    on_exit_now: what must be saved before the process exits at once (a second signal)."""

    signal_name: str | None = None
    exit_code: int = 0
    on_exit_now: Callable[[], str | None] | None = None  # returns what to tell the user, if anything
    finalizing: bool = False  # every line is journaled and the output is being written: a signal lets it finish

    @property
    def requested(self) -> bool:
        return self.signal_name is not None


class JobInterrupted(Exception):
    pass


@dataclass(frozen=True)
class LazyEngine:
    """An engine loaded only when the first line that needs it is reached: a job whose lines
    are all errors, or all answered by an earlier run, never loads the model."""

    config: object  # EngineConfig: what the journal header records
    load: Callable[[], LLMEngine]


@dataclass(frozen=True)
class BatchJobSummary:
    output_path: str
    num_requests: int  # answered successfully (including ones resumed from the journal)
    num_errors: int  # lines that became error records
    num_prompt_tokens: int  # of this run's requests
    num_output_tokens: int
    num_steps: int
    seconds: float  # generation: engine time (after loading and tokenizing)
    num_resumed: int = 0  # records taken from an earlier run's journal
    journal_path: str = ""
    interrupted_by: str | None = None  # signal name when stopped early (no final output yet)
    load_seconds: float | None = None  # loading the model (None: this run loaded none)
    num_answered_now: int = 0  # requests the engine answered in this run
    # prompt tokens whose KV this run computed (the rest came from shared prefixes); None where
    # the engine does not report its steps (Ray replicas)
    num_computed_prompt_tokens: int | None = None

    def describe(self) -> str:
        if self.interrupted_by:
            return (f"interrupted by {self.interrupted_by}: {self.num_requests} requests answered and "
                    f"{self.num_errors} errors are saved in {self.journal_path}.\n"
                    f"Run the same command again to resume (add --restart to start over).")
        resumed = f" ({self.num_resumed} resumed from an earlier run)" if self.num_resumed else ""
        lines = [f"{self.num_requests} requests answered, {self.num_errors} errors -> {self.output_path}{resumed}"]
        if self.load_seconds is not None:
            lines.append(f"model loaded in {self.load_seconds:.1f} s")
        if self.num_steps:
            seconds = max(self.seconds, 1e-9)
            lines.append(f"generation: {self.seconds:.2f} s, {self.num_answered_now / seconds:.2f} requests/s, "
                         f"{self.num_output_tokens / seconds:.1f} generated tokens/s ({self.num_steps} steps)")
            lines.append(f"tokens: {self.num_prompt_tokens:,} prompt{self._prefix_sharing()}, "
                         f"{self.num_output_tokens:,} generated")
        return "\n".join(lines)

    def _prefix_sharing(self) -> str:
        computed = self.num_computed_prompt_tokens
        if computed is None or not self.num_prompt_tokens:
            return ""
        saved = self.num_prompt_tokens - computed
        return f" ({computed:,} computed: prefix sharing saved {saved:,}, {saved / self.num_prompt_tokens:.1%})"


def tokenize_request(engine: LLMEngine, request: BatchRequest, max_num_tokens: int | None = None,
                     chat_template: str | None = None) -> list[int]:
    """The prompt's token ids; with max_num_tokens, tokenizing may stop once the prompt is
    known to hold more (the result is then a prefix, longer than max_num_tokens). chat_template:
    renders chat messages instead of the model's template."""
    if request.prompt_token_ids is not None:
        return list(request.prompt_token_ids)
    if engine.tokenizer is None:
        raise NoTokenizerError(f"model {engine.model_name} has no tokenizer: give prompt_token_ids")
    if request.messages is not None:
        return engine.tokenizer.encode_chat(request.messages, max_num_tokens=max_num_tokens,
                                            chat_template=chat_template)
    return engine.tokenizer.encode_prompt(request.prompt, max_num_tokens=max_num_tokens)


def prepare_request(engine: LLMEngine, request: BatchRequest, limits: RequestLimits | None = None,
                    chat_template: str | None = None):
    """(int32 token ids, checked params) or an error record (prompt too long, no tokenizer, ...).
    limits: what a request may hold (default: the engine's)."""
    limits = limits or engine.limits
    try:
        token_ids = tokenize_request(engine, request, max_num_tokens=limits.token_limit, chat_template=chat_template)
    except NoTokenizerError as error:
        return error_line(request.custom_id, "invalid_request", str(error), request.line_number)
    except Exception as error:  # a tokenizer or chat template failing on one line's content
        return error_line(request.custom_id, "tokenization_failed", f"{type(error).__name__}: {error}",
                          request.line_number)
    ids = token_id_array(token_ids)
    try:
        # clamps max_tokens (README); a text prompt's tokenizing stops past the limit (cut)
        params = limits.check(token_ids if ids is None else ids, request.sampling,
                              cut=request.prompt_token_ids is None)
    except InvalidRequestError as error:
        code = _ERROR_CODES.get(type(error), "invalid_request")
        return error_line(request.custom_id, code, str(error), request.line_number)
    try:  # a bad schema, regex or grammar is this line's error; a good one starts compiling
        engine.check_structured_outputs(params)
    except StructuredOutputError as error:
        return error_line(request.custom_id, "invalid_request", str(error), request.line_number)
    if ids is not None and int(ids.max()) < 1 << 31:
        return ids.astype(np.int32), params
    return np.asarray(token_ids, dtype=np.int32), params


def count_lines(path: str, chunk_num_bytes: int = 1 << 20) -> int:
    num_lines, last = 0, b"\n"
    with file_operation("read", path), open(path, "rb") as handle:
        while chunk := handle.read(chunk_num_bytes):
            num_lines += chunk.count(b"\n")
            last = chunk[-1:]
    return num_lines + (last != b"\n")


def run_batch_file(engine: LLMEngine | LazyEngine, input_path: str, output_path: str,
                   options: BatchJobOptions | None = None,
                   stop: StopRequest | None = None) -> BatchJobSummary:
    """Answer every line of input_path into output_path. Before any work it refuses unusable
    paths (JobFilesError), a job already writing this output (JobLockedError) and a journal of
    a job with other options (JournalMismatchError); see batchllm/io/job_files.py."""
    options = options or BatchJobOptions()
    check_job_paths(input_path, output_path, options.errors_path)
    with JobLock(output_path):
        check_existing_output(output_path, options.overwrite, options.restart)
        return _run_locked(engine, input_path, output_path, options, stop or StopRequest())


def _run_locked(engine, input_path: str, output_path: str, options: BatchJobOptions,
                stop: StopRequest) -> BatchJobSummary:
    num_lines = count_lines(input_path)
    journal = Journal(journal_path_for(output_path),
                      job_header(engine.config, options.max_line_bytes, options.chat_template),
                      restart=options.restart, num_input_lines=num_lines)
    _print_resume(journal)
    run = _JobRun(engine, journal, options, stop, num_lines)
    stop.on_exit_now = _flush_journal(journal)
    completed = False
    try:
        run.stream(input_path)
        completed = True
    except JobInterrupted:
        pass
    except BaseException as error:
        stop.on_exit_now = None
        with contextlib.suppress(JobFileError):
            journal.close()
        if journal.counts(confirmed_only=False) != (0, 0) and not isinstance(error, _SAYS_HOW_TO_GO_ON):
            print(f"note: the records done so far are saved in {journal.path}: "
                  "run the same command again to resume", file=sys.stderr)
        raise
    finally:
        run.progress.close()
    if completed:
        _finalize(journal, run, output_path, options, stop)
    else:
        stop.on_exit_now = None
        journal.close()
    run.print_notes(input_path)
    num_answered, num_errors = journal.counts(confirmed_only=completed)
    stats = run.stats
    computed = run.num_computed_prompt_tokens if run.num_recorded_steps == stats.num_steps else None
    return BatchJobSummary(output_path, num_answered, num_errors, stats.num_prompt_tokens, stats.num_output_tokens,
                           stats.num_steps, stats.seconds, journal.resume.num_entries, journal.path,
                           None if completed else stop.signal_name, run.load_seconds, run.progress.num_answered,
                           computed)


def _flush_journal(journal: Journal) -> Callable[[], str]:
    def flush() -> str:
        journal.flush_for_exit()
        return "the records already journaled are kept"
    return flush


def _finalize(journal: Journal, run: _JobRun, output_path: str, options: BatchJobOptions,
              stop: StopRequest) -> None:
    """Write the output from the journal. Every line is journaled by now, so a first signal
    lets this finish (the job then reports success); a second one exits at once, and as long
    as the journal exists the same command finishes the output."""
    stop.finalizing = True

    def exit_now() -> str:
        if os.path.exists(journal.path):
            return f"the output was being written; {journal.path} is kept: run the same command again to finish it"
        return f"the output {output_path} is complete"

    stop.on_exit_now = exit_now
    try:
        journal.finalize(output_path, options.order, options.errors_path, run.num_records)
    except BaseException as error:
        if not isinstance(error, _SAYS_HOW_TO_GO_ON):
            print(f"note: every record is saved in {journal.path}: run the same command again to write the "
                  "output", file=sys.stderr)
        raise
    finally:
        stop.on_exit_now = None
    if stop.requested:
        print(f"{stop.signal_name} arrived after every line was answered: the output {output_path} is complete",
              file=sys.stderr)


def _print_resume(journal: Journal) -> None:
    resume = journal.resume
    if resume == ResumeReport(0, 0, 0):  # a fresh journal
        return
    print(f"resuming from {journal.path}: {resume.num_entries} records kept"
          + (f", a torn last line ({resume.num_torn_bytes} bytes) dropped" if resume.num_torn_bytes else "")
          + (f", {resume.num_corrupt_lines} corrupt lines dropped" if resume.num_corrupt_lines else "")
          + (f", {resume.num_superseded} superseded records dropped" if resume.num_superseded else "")
          + (f", {resume.num_out_of_range} records for lines the input does not have dropped"
             if resume.num_out_of_range else ""), file=sys.stderr)


class _JobRun:
    """The streaming loop of one job: parse -> window -> engine -> journal."""

    def __init__(self, engine, journal: Journal, options: BatchJobOptions, stop: StopRequest,
                 num_lines: int) -> None:
        self._engine = None
        self._engine_source = engine
        self.limits: RequestLimits | None = None  # what a request may hold, settled when the engine loads
        self.journal, self.options, self.stop = journal, options, stop
        self.stats = RunStats()
        self.load_seconds: float | None = None
        # prefill tokens computed, from the engine's step records (folded in and dropped after each window)
        self.num_computed_prompt_tokens = 0
        self.num_recorded_steps = 0
        self.num_warnings = 0
        self.num_records = 0  # input lines that get a record (every line but blank ones)
        self._num_lines_answered = 0  # by the engine since the last step's progress update
        # fields accepted without effect: (field, reason) -> [number of lines, first line]
        self.field_warnings: dict[FieldWarning, list[int]] = {}
        self.progress = Progress(num_lines, enabled=options.show_progress, description="lines", unit="lines")

    @property
    def engine(self) -> LLMEngine:
        """The engine, loaded at the first line that needs it. Its dtype and token limit are
        checked against the journal's (job_identity), or journaled before any record that
        depends on them."""
        if self._engine is None:
            source = self._engine_source
            if isinstance(source, LazyEngine):
                started = time.perf_counter()
                engine = source.load()
                self.load_seconds = time.perf_counter() - started
            else:
                engine = source
            settings = engine_settings(engine)
            check_engine_settings(self.journal.path, self.journal.engine_settings, settings)
            self.limits = held_limits(engine.limits, self.journal.engine_settings)
            if self.journal.engine_settings is None:
                self.journal.record_engine(settings)
            elif self.limits.token_limit < settings["token_limit"]:
                print(f"note: {self.journal.path} was answered with up to {self.limits.token_limit} tokens a "
                      f"request; this engine allows {settings['token_limit']}, and the job keeps "
                      f"{self.limits.token_limit} so that answers do not mix", file=sys.stderr)
            self._engine = engine
        return self._engine

    def stream(self, input_path: str) -> None:
        pending: list[_Runnable] = []
        num_pending_samples = 0  # a line of n samples is n requests to the engine
        for item in _read_input(input_path, self.options.max_line_bytes):
            if self.stop.requested:
                raise JobInterrupted
            self.num_records += 1
            if isinstance(item, BatchError):
                if item.code == "duplicate_custom_id" or not self.journal.keep(item.line_number, item.digest):
                    self._write(item, error_line(item.custom_id, item.code, item.message, item.line_number))
                else:
                    self.progress.skip(1)  # its error record is kept from an earlier run
                continue
            if self.journal.keep(item.line_number, item.digest):
                self.progress.skip(1)  # answered by an earlier run
                continue
            for warning in item.warnings:
                self.field_warnings.setdefault(warning, [0, item.line_number])[0] += 1
            engine = self.engine  # loading the model is not one line's fault
            try:
                prepared = prepare_request(engine, item, self.limits, self.options.chat_template)
            except Exception as error:
                prepared = self._internal_error(item, error)
            if isinstance(prepared, dict):
                self._write(item, prepared)
                continue
            # the output line needs no prompt: it is held as int32 token ids
            stripped = replace(item, messages=None, prompt=None, prompt_token_ids=None, warnings=())
            pending.append((stripped, *prepared))
            num_pending_samples += prepared[1].n
            window = self.options.window_num_requests
            if window is not None and num_pending_samples >= window:
                self._run_window(pending)
                num_pending_samples = 0
        if pending:
            self._run_window(pending)

    def _run_window(self, pending: list[_Runnable]) -> None:
        prepared = [PreparedRequest(request.line_number, ids.tolist(), params, ids)
                    for request, ids, params in pending]
        requests = {request.line_number: request for request, _, _ in pending}
        pending.clear()
        self.progress.start()
        try:
            self._serve(prepared, requests)
        finally:
            self._fold_step_records()
            self.progress.update(self._num_lines_answered, 0)  # lines answered after the last step's update
            self._num_lines_answered = 0
        self.journal.sync()

    def _fold_step_records(self) -> None:
        """Count the window's computed prefill tokens and drop its step records (a long job keeps
        no record per step)."""
        records = self.stats.step_records
        self.num_computed_prompt_tokens += sum(r.num_distinct_tokens + r.num_prefix_tokens for r in records)
        self.num_recorded_steps += len(records)
        records.clear()

    def _serve(self, prepared: list[PreparedRequest], requests: dict[int, BatchRequest]) -> None:
        """Run requests (a line of n samples is n engine requests, answered once the last finishes);
        if the engine fails, the unanswered lines run again (all their samples) in halves until the
        line that fails alone is found: it gets an internal_error record, the rest their answers.
        An engine that can run nothing any more stops the job (the journal keeps what is done)."""
        split = SampleSplit(self.engine.config.seed, max(request.request_id for request in prepared) + 1)
        samples = [sample for request in prepared for sample in split.split(request)]
        try:
            for done in self.engine.run(samples, on_step=self._on_step, stats=self.stats):
                gathered = split.gather(done)
                if gathered is not None:
                    self._answer(requests.pop(gathered[0]), gathered[1])
        except (JobInterrupted, EngineBrokenError, JobFileError):
            raise  # the job stops (the journal keeps what is done): not one request's fault
        except Exception as error:
            left = [request for request in prepared if request.request_id in requests]
            if len(left) == 1:
                request = requests.pop(left[0].request_id)
                self._write(request, self._internal_error(request, error))
            elif left:
                half = len(left) // 2
                self._serve(left[:half], requests)
                self._serve(left[half:], requests)

    def _answer(self, request: BatchRequest, outputs: list[FinishedOutput]) -> None:
        """The line's one record from its samples' outputs: its answer, or the first failed sample's error."""
        try:
            failed = next((done for done in outputs if done.error is not None), None)
            if failed is not None:
                code = "internal_error" if failed.error.startswith("internal_error") else "invalid_request"
                record = error_line(request.custom_id, code, failed.error, request.line_number)
            else:
                record = self._success_record(request, outputs)
        except Exception as error:
            record = self._internal_error(request, error)
        self.journal.append(request.line_number, record, dumps(record), request.digest)
        self._num_lines_answered += 1

    def _success_record(self, request: BatchRequest, outputs: list[FinishedOutput]) -> dict:
        engine, first = self.engine, outputs[0]
        # without a tokenizer the text is empty: the token ids are the answer
        token_ids_wanted = request.return_token_ids
        if token_ids_wanted is None:
            token_ids_wanted = engine.tokenizer is None
        prompt_token_ids = first.prompt_token_ids if token_ids_wanted else None
        # the prompt's logprobs are sample 0's (the samples share the prompt: engine/samples.py)
        prompt_logprobs = _prompt_logprobs(engine, first, request)
        prompt_text = _prompt_text(engine, request, first) if request.echo else None
        choices = []
        for index, done in enumerate(outputs):
            text, logprobs = done.text, _openai_logprobs(engine, done, request)
            if request.echo:
                text, logprobs = echo_completion(prompt_text, first.prompt_token_ids, first.prompt_logprobs,
                                                 _vocabulary(engine), text, logprobs)
            choices.append(choice(request.endpoint, index, text, done.finish_reason, logprobs,
                                  done.output_token_ids if token_ids_wanted else None, prompt_token_ids,
                                  prompt_logprobs))
        return success_line(request.custom_id, request.endpoint, engine.model_name, choices,
                            len(first.prompt_token_ids), sum(len(done.output_token_ids) for done in outputs),
                            first.num_cached_prompt_tokens, prompt_token_ids, prompt_logprobs)

    def _internal_error(self, item: BatchRequest, error: Exception) -> dict:
        message = f"{type(error).__name__}: {error}"
        self._print_warning(f"line {item.line_number} ({item.custom_id}): internal error, recorded as "
                            f"internal_error: {message}")
        return error_line(item.custom_id, "internal_error", message, item.line_number)

    def _on_step(self, num_finished: int, num_new_tokens: int) -> None:
        """The engine's on_step; the bar counts lines, answered once all their samples finished."""
        self.progress.update(self._num_lines_answered, num_new_tokens)
        self._num_lines_answered = 0
        self.journal.maybe_sync()
        if self.stop.requested:
            raise JobInterrupted

    def _write(self, item: BatchRequest | BatchError, record: dict) -> None:
        self.journal.append(item.line_number, record, dumps(record), item.digest)
        self.progress.skip(1)

    def _print_warning(self, text: str) -> None:
        self.num_warnings += 1
        if self.num_warnings <= self.options.max_printed_warnings:
            print(f"warning: {text}", file=sys.stderr)

    def print_notes(self, input_path: str) -> None:
        """After the run: hidden warnings, lines answered again because they changed, and a job
        with nothing to run."""
        if self.num_warnings > self.options.max_printed_warnings:
            print(f"warning: {self.num_warnings - self.options.max_printed_warnings} more warnings not shown",
                  file=sys.stderr)
        for warning, (num_lines, first_line) in sorted(self.field_warnings.items(), key=lambda item: -item[1][0]):
            print(f"warning: {num_lines:,} line{'s' if num_lines > 1 else ''} had {warning} (first: line {first_line})",
                  file=sys.stderr)
        if self.journal.num_changed:
            print(f"note: {self.journal.num_changed} lines of {input_path} changed since the earlier run: "
                  "answered again", file=sys.stderr)
        never_loaded = isinstance(self._engine_source, LazyEngine) and self._engine is None
        if never_loaded and not self.stop.requested and self.journal.counts()[0] == 0:
            print(f"warning: {input_path} has no line that can run (only errors or blank lines): "
                  "the model was not loaded", file=sys.stderr)


def _read_input(path: str, max_line_bytes: int):
    """read_batch_file, with a fault reading the input a JobFileError naming it."""
    items = read_batch_file(path, max_line_bytes)
    while True:
        with file_operation("read", path):
            item = next(items, None)
        if item is None:
            return
        yield item


def _vocabulary(engine: LLMEngine):
    return engine.tokenizer.vocabulary if engine.tokenizer is not None else None  # None: "token_id:N"


def _prompt_text(engine: LLMEngine, request: BatchRequest, done) -> str:
    """The prompt as text for echo: as given, or its token ids decoded."""
    if request.prompt is not None:
        return request.prompt
    if engine.tokenizer is None:
        return ""
    return engine.tokenizer.decode(done.prompt_token_ids, skip_special_tokens=request.sampling.skip_special_tokens)


def _prompt_logprobs(engine: LLMEngine, done, request: BatchRequest) -> list | None:
    """vLLM's prompt_logprobs field, whenever they were computed (as vLLM does, echo's too)."""
    if done.prompt_logprobs is None:
        return None
    return vllm_prompt_logprobs(done.prompt_token_ids, done.prompt_logprobs, done.prompt_token_ranks,
                                _vocabulary(engine))


def _openai_logprobs(engine: LLMEngine, done, request: BatchRequest) -> dict | None:
    if done.logprobs is None:
        return None
    vocabulary = _vocabulary(engine)
    return openai_logprobs(request.endpoint, done.output_token_ids, done.logprobs, request.sampling.logprobs,
                           vocabulary, done.text, request.sampling.skip_special_tokens)
