"""What determines a batch job's answers, recorded in its journal so that a resume never mixes
answers of two setups (README, "Crashes, Ctrl-C and resuming").

Known before the model loads (the journal header): the model's identity (its files' names,
sizes and modification times; a random preset's full spec), the dtype and device kind it runs
in, quantization, the KV cache dtype, the seed, --max-model-len, --max-line-bytes, the
sampling defaults and --chat-template. Known once the engine has loaded (a journal line of its
own): its dtype and the most tokens one request may hold (context and KV cache), which clamps
max_tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

from batchllm.engine.request_limits import RequestLimits
from batchllm.io.journal import JournalHeader, JournalMismatchError
from batchllm.models.default_model import RANDOM_PREFIX
from batchllm.models.model_path import find_model_files
from batchllm.sampling_params import SamplingParams

HEADER_LABELS = {
    "model": "--model", "model_files": "--model (its files)", "dtype": "--dtype", "device": "--device",
    "quantization": "--quantization", "kv_cache_dtype": "--kv-cache-dtype", "seed": "--seed",
    "max_model_len": "--max-model-len", "max_line_bytes": "--max-line-bytes",
    "sampling_defaults": "the sampling defaults (another batchllm version)",
    "chat_template": "--chat-template (a digest of its text)",
}


def job_header(config, max_line_bytes: int, chat_template: str | None = None) -> JournalHeader:
    """The journal header of a job on EngineConfig `config`. Records written before any engine
    ran (a line that does not parse, a duplicate id, a line over --max-line-bytes) depend only on
    --max-line-bytes, so the engine's options may change until an engine has run (e.g. a --model
    that could not load, fixed)."""
    device, dtype = resolved_device_and_dtype(config)
    model = config.model
    if model and not model.startswith(RANDOM_PREFIX) and os.path.exists(model):
        model = os.path.abspath(model)
    sampling_defaults = json.loads(json.dumps(dataclasses.asdict(SamplingParams()), default=repr))
    return JournalHeader({
        "model": model or "default", "model_files": model_fingerprint(config.model), "dtype": dtype,
        "device": device, "quantization": config.quantization, "kv_cache_dtype": config.cache.kv_cache_dtype,
        "seed": config.seed, "max_model_len": config.max_model_len, "max_line_bytes": max_line_bytes,
        "sampling_defaults": sampling_defaults,
        "chat_template": None if chat_template is None else _digest(chat_template),
    }, HEADER_LABELS, frozenset(HEADER_LABELS) - {"max_line_bytes"})


def resolved_device_and_dtype(config) -> tuple[str, str]:
    """("cpu" | "cuda", "float32" | ...): what "auto" becomes on this machine, as the engine
    resolves it (without loading the model). An unusable --device is kept as given: loading
    the model then refuses it."""
    from batchllm.engine.loading import resolve_device, resolve_dtype

    try:
        device = resolve_device(config.device)
    except (RuntimeError, ValueError):
        return config.device, config.dtype
    return device.type, str(resolve_dtype(config.dtype, device)).removeprefix("torch.")


def model_fingerprint(spec: str | None) -> str | None:
    """A digest of what the model's answers come from: for a file or directory (a model id's
    snapshot in the Hugging Face cache) the names, sizes and modification times of its files (a
    model replaced under the same path differs); for a random preset its resolved architecture
    and seed. None where nothing is found (loading the
    model then fails with its own message)."""
    if spec is not None and spec.startswith(RANDOM_PREFIX):
        return _random_fingerprint(spec)
    try:
        path = str(find_model_files(spec).path)  # a model id: its snapshot in the Hugging Face cache
    except FileNotFoundError:
        return None
    except ValueError:  # a path that is no model: its files still identify it
        path = os.path.expanduser(spec)
    if os.path.isfile(path):
        files = [(os.path.basename(path), os.stat(path))]
    elif os.path.isdir(path):
        files = [(os.path.relpath(name, path), os.stat(name)) for name in _files_under(path)]
    else:
        return None
    listing = [[name, stat.st_size, stat.st_mtime_ns] for name, stat in sorted(files)]
    return _digest(listing)


def _files_under(directory: str) -> list[str]:
    """Every file below directory, hidden names (e.g. a download cache) left out."""
    found = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = [name for name in dirs if not name.startswith(".")]
        found += [os.path.join(root, name) for name in files if not name.startswith(".")]
    return found


def _random_fingerprint(spec: str) -> str | None:
    from batchllm.models.presets import parse_random_spec

    try:
        parsed = parse_random_spec(spec)
    except (ValueError, KeyError, TypeError):
        return None
    return _digest({"config": dataclasses.asdict(parsed.config), "seed": parsed.seed})


def _digest(value) -> str:
    data = json.dumps(value, sort_keys=True, default=repr).encode()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def engine_settings(engine) -> dict:
    """What the loaded engine settled: its dtype and the most tokens (prompt + generated) one
    request may hold, with the context length and KV cache size behind that limit."""
    limits = engine.limits
    dtype = getattr(engine, "dtype", None)
    return {"dtype": None if dtype is None else str(dtype).removeprefix("torch."),
            "token_limit": limits.token_limit, "max_model_len": limits.max_model_len,
            "num_kv_tokens": limits.num_kv_blocks * limits.block_size}


def check_engine_settings(journal_path: str, recorded: dict | None, current: dict) -> None:
    """Raise JournalMismatchError if this engine cannot give the journal's answers again: its
    dtype differs (where both are known: a Ray driver does not hold the model), or it allows
    fewer tokens a request (max_tokens would be clamped differently). recorded: the journal's
    engine settings (None: no engine ran for it yet); current: engine_settings(engine)."""
    if recorded is None:
        return
    if None not in (recorded.get("dtype"), current["dtype"]) and recorded.get("dtype") != current["dtype"]:
        raise JournalMismatchError(
            f"{journal_path} was answered in {recorded.get('dtype')} and this engine runs in {current['dtype']} "
            "(--dtype): resume with the earlier --dtype and --device, or add --restart to start over")
    old_limit = recorded.get("token_limit")
    if not isinstance(old_limit, int) or old_limit < 1:
        raise JournalMismatchError(f"{journal_path} has a damaged engine line: add --restart to start over")
    if current["token_limit"] < old_limit:
        raise JournalMismatchError(
            f"{journal_path} was answered with up to {old_limit} tokens a request (prompt + max_tokens; "
            f"--max-model-len {recorded.get('max_model_len')}, --kv-cache-tokens {recorded.get('num_kv_tokens')}); "
            f"this run allows {current['token_limit']} (--max-model-len {current['max_model_len']}, "
            f"--kv-cache-tokens {current['num_kv_tokens']}), which would clamp answers differently: resume with "
            f"--kv-cache-tokens {recorded.get('num_kv_tokens')} (on a GPU: more free memory or a higher "
            "--gpu-memory-utilization), or add --restart to start over")


def held_limits(limits: RequestLimits, recorded: dict | None) -> RequestLimits:
    """This engine's limits, held to the journal's token limit when it allows more (checked by
    check_engine_settings): the earlier context and KV size where they give that limit, so even
    error messages read as before; else the context capped to it."""
    if recorded is None or limits.token_limit <= recorded["token_limit"]:
        return limits
    max_model_len, num_kv_tokens = recorded.get("max_model_len"), recorded.get("num_kv_tokens")
    if isinstance(max_model_len, int) and isinstance(num_kv_tokens, int):
        earlier = dataclasses.replace(limits, max_model_len=max_model_len,
                                      num_kv_blocks=num_kv_tokens // limits.block_size)
        if earlier.token_limit == recorded["token_limit"]:
            return earlier
    return dataclasses.replace(limits, max_model_len=recorded["token_limit"])
