"""What a benchmark runs (outputs forced to max_tokens, docs/design.md): a generated workload
(micro:P:D:SD, industrial, uniform:ISL:OSL; batchllm.perf.workloads) or the requests of a JSONL file
(`--input FILE`)."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from batchllm.io.batch_input import BatchError, read_batch_file
from batchllm.perf.workloads import Workload, industrial_workload, micro_workload, uniform_workload

DEFAULT_WORKLOAD = "micro:2000:200:16"
# Request counts of TensorRT-LLM's throughput table for its uniform ISL/OSL rows (its performance
# overview, `docs/source/performance/perf-overview.md`): enough requests to reach a steady state
# (short requests enter and leave fast, so more of them).
UNIFORM_DEFAULT_REQUESTS = {(128, 128): 30_000, (128, 2048): 3_000, (128, 4096): 1_500, (500, 2000): 3_000,
                            (1000, 1000): 3_000, (1000, 2000): 1_500, (2048, 128): 3_000, (2048, 2048): 1_500,
                            (5000, 500): 1_500, (20000, 2000): 1_000}


def make_workload(spec: str, num_requests: int, output_tokens: int, vocab_size: int, seed: int) -> Workload:
    """'micro:P:D:SD' (prefix P tokens, D distinct tokens, sharing degree SD), 'industrial', or
    'uniform:ISL:OSL' (ISL random prompt tokens, OSL output tokens: output_tokens is not used)."""
    kind, *values = spec.split(":")
    if kind == "uniform":
        input_num_tokens, output_num_tokens = _uniform_lengths(spec)
        return uniform_workload(input_num_tokens, output_num_tokens, num_requests, vocab_size=vocab_size, seed=seed)
    if kind == "micro":
        try:
            prefix, distinct, degree = (int(v) for v in values)
        except ValueError:
            raise SystemExit(f"bad workload {spec!r}: micro:P:D:SD takes three integers, e.g. micro:2000:200:16")
        return micro_workload(prefix, distinct, degree, num_requests=num_requests, output_num_tokens=output_tokens,
                              vocab_size=vocab_size, seed=seed)
    if kind == "industrial" and not values:
        return industrial_workload(num_requests=num_requests, output_num_tokens=output_tokens, vocab_size=vocab_size,
                                   seed=seed)
    raise SystemExit(f"unknown workload {spec!r}: micro:P:D:SD, industrial or uniform:ISL:OSL")


def _uniform_lengths(spec: str) -> tuple[int, int]:
    try:
        input_num_tokens, output_num_tokens = (int(v) for v in spec.split(":")[1:])
    except ValueError:
        raise SystemExit(f"bad workload {spec!r}: uniform:ISL:OSL takes two integers, e.g. uniform:128:128")
    if input_num_tokens < 1 or output_num_tokens < 1:
        raise SystemExit(f"bad workload {spec!r}: ISL and OSL must be >= 1")
    return input_num_tokens, output_num_tokens


def prepared_requests(workload: Workload) -> list:
    """The workload's requests as an engine takes them (engine.run): request id = position, greedy,
    EOS ignored, so every output runs to its max_tokens."""
    from batchllm.engine.request_state import PreparedRequest
    from batchllm.sampling_params import SamplingParams

    return [PreparedRequest(index, prompt.tolist(), SamplingParams(temperature=0, max_tokens=int(max_tokens),
                                                                  ignore_eos=True), prompt)
            for index, (prompt, max_tokens) in enumerate(zip(workload.prompts, workload.max_tokens))]


def split_workload_spec(text: str, default_requests: int) -> tuple[str, int]:
    """'industrial#2000' -> ('industrial', 2000); 'micro:2000:200:16' -> (..., default_requests);
    'uniform:128:128' -> (..., 30000): a uniform row of TensorRT-LLM's table has its request count."""
    spec, _, count = text.partition("#")
    if not count and spec.startswith("uniform:"):
        default_requests = UNIFORM_DEFAULT_REQUESTS.get(_uniform_lengths(spec), default_requests)
    try:
        return spec, int(count) if count else default_requests
    except ValueError:
        raise SystemExit(f"bad workload {text!r}: the request count after '#' must be an integer")


def read_input_workload(path: str, engine, default_max_tokens: int) -> tuple[Workload, list[BatchError]]:
    """The requests of an OpenAI-Batch (or short-form) JSONL file, tokenized as `batchllm run` does
    (chat template / prompt through the model's tokenizer, prompt_token_ids as they are), and the
    skipped lines: a line that does not parse, cannot be tokenized (e.g. text on a random: preset,
    which has no tokenizer), or does not fit the model. Each line's max_tokens is kept (clamped to
    the context like `batchllm run`; absent: 16 on a completion line as in `batchllm run`,
    default_max_tokens on a chat line rather than the whole context); outputs are forced to that
    length by the caller (ignore_eos). The workload is named after the file."""
    from batchllm.job.batch_job import prepare_request

    prompts: list[np.ndarray] = []
    max_tokens: list[int] = []
    custom_ids: list[str] = []
    skipped: list[BatchError] = []
    for item in read_batch_file(path):
        if isinstance(item, BatchError):
            skipped.append(item)
            continue
        if item.prompt_token_ids is None and engine.tokenizer is None:
            skipped.append(BatchError(item.line_number, "invalid_request",
                                      f"model {engine.model_name} has no tokenizer (random: presets have none): "
                                      "this line needs prompt_token_ids"))
            continue
        sampling = item.sampling
        if sampling.max_tokens is None:
            sampling = dataclasses.replace(sampling, max_tokens=default_max_tokens)
            item = dataclasses.replace(item, sampling=sampling)
        prepared = prepare_request(engine, item)
        if isinstance(prepared, dict):  # an error record
            error = prepared.get("error") or {}
            skipped.append(BatchError(item.line_number, error.get("code", "invalid_request"),
                                      error.get("message", "cannot run")))
            continue
        token_ids, params = prepared
        prompts.append(np.asarray(token_ids, dtype=np.int32))
        max_tokens.append(int(params.max_tokens))
        custom_ids.append(item.custom_id)
    workload = Workload(name=os.path.basename(path), custom_ids=tuple(custom_ids), prompts=tuple(prompts),
                        max_tokens=tuple(max_tokens))
    return workload, skipped
