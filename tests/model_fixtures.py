"""Session fixtures for model tests, shared through pytest's plugin mechanism.

Use from any test module (tests/ is on sys.path under pytest's default import mode):

    pytest_plugins = ["model_fixtures"]

Registered as a plugin, each fixture exists once per session (importing the fixture functions
into several modules instead would load the models once per module). Helpers (reference
attention, flat-batch runner) live in tests/model_helpers.py.

Engines, loaded once per session (loading the default model and its GGUF tokenizer costs
about 12 s of CPU):

    default_llm / default_engine   SmolLM2-135M-Instruct, float32 on CPU, DEFAULT_KV_CACHE_TOKENS
    tiny_engine                    random:tiny, float32 on CPU, 4096 KV tokens

These are function-scoped views of the session objects: whatever settings a test rebinds on the
engine (`engine.configure_scheduler(...)`, `engine.config`, ...) are restored after it,
so tests reconfigure them freely between runs. `session_default_llm` and `session_tiny_engine`
are the session objects themselves, for module- or session-scoped fixtures that only run them
(never reconfigure). A test that needs another model, KV cache size or attention backend builds
its own engine.

For the CLI called in-process: cli_default_engine (`batchllm run` without --model gets the session's
default engine) and cli_default_tokenizer (`analyze` / `simulate` get its tokenizer).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest
import torch

from model_helpers import default_gguf_path

DEFAULT_KV_CACHE_TOKENS = 4096  # the shared default engine's KV cache (token limit 4080)


@pytest.fixture(scope="session")
def default_model():
    """Our LoadedModel of the default GGUF (SmolLM2-135M-Instruct Q4_1), float32 on CPU; the
    seconds its load took are in default_model_load_seconds."""
    from batchllm.models.loader import load_model

    start = time.perf_counter()
    model = load_model(str(default_gguf_path()), dtype=torch.float32, device="cpu")
    _load_seconds["default_model"] = time.perf_counter() - start
    return model


_load_seconds: dict[str, float] = {}


@pytest.fixture(scope="session")
def default_model_load_seconds(default_model) -> float:
    """Wall seconds that loading default_model took (GGUF read, dequantized, moved to the device)."""
    return _load_seconds["default_model"]


@pytest.fixture(scope="session")
def hf_default_model():
    """transformers' AutoModelForCausalLM of the same GGUF, float32 on CPU, eval mode.

    transformers reads the GGUF with the gguf package: it parses the file twice (config, then
    weights) and builds gguf's tensor-name table once per module of the model, about 9 s of CPU
    together. While it loads, both are memoized (same file, same table); the weights are the
    ones transformers itself dequantizes."""
    import functools

    import gguf
    from transformers import AutoModelForCausalLM

    path = default_gguf_path()
    readers = {}

    def shared_reader(file_path, *args, **kwargs):
        key = (str(file_path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = gguf_reader(file_path, *args, **kwargs)
        return readers[key]

    gguf_reader = gguf.GGUFReader
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", shared_reader)
        patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def hf_prompt_token_ids(llm, completions: list[str], chats: list[list[dict]]) -> list[list[int]]:
    """Prompt ids from transformers' own tokenizer calls (the GGUF's AutoTokenizer, as loaded for
    the engine: loading it again costs seconds), not from the engine's encode_* methods."""
    tokenizer = llm.engine.tokenizer.hf
    ids = [tokenizer(text).input_ids for text in completions]
    for messages in chats:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids.append(tokenizer(text, add_special_tokens=False).input_ids)
    return ids


@contextmanager
def _settings_restored(engine):
    """Afterwards, put back every attribute of engine that the test rebound (scheduler config,
    asynchronous scheduling, ...); the model, KV cache and runner stay the same objects."""
    saved = dict(vars(engine))
    try:
        yield
    finally:
        vars(engine).update(saved)


@pytest.fixture(scope="session")
def session_default_llm():
    from batchllm import LLM

    default_gguf_path()  # skips when the default model is not installed

    return LLM(dtype="float32", device="cpu", kv_cache_tokens=DEFAULT_KV_CACHE_TOKENS)


@pytest.fixture
def default_llm(session_default_llm):
    """The session's LLM of the default model; its engine's settings are restored after the test."""
    with _settings_restored(session_default_llm.engine):
        yield session_default_llm


@pytest.fixture
def default_engine(default_llm):
    """The session's LLMEngine of the default model (the one inside default_llm)."""
    return default_llm.engine


@pytest.fixture(scope="session")
def session_tiny_engine():
    from batchllm.config import engine_config
    from batchllm.engine.llm_engine import LLMEngine

    return LLMEngine(engine_config("random:tiny", dtype="float32", device="cpu", kv_cache_tokens=4096))


@pytest.fixture
def tiny_engine(session_tiny_engine):
    """The session's LLMEngine of random:tiny (float32, CPU, 4096 KV tokens); settings restored after."""
    with _settings_restored(session_tiny_engine):
        yield session_tiny_engine


def _is_default_model_on_cpu(config) -> bool:
    """An EngineConfig that asks for what the session's default engine is: the default model, float32
    on the CPU (auto means float32 and the CPU on a machine without CUDA)."""
    cpu = config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available())
    return (config.model is None and cpu and config.dtype in ("auto", "float32") and config.max_model_len is None
            and config.attention_backend == "auto")


@pytest.fixture
def cli_default_engine(default_engine, monkeypatch):
    """`batchllm run` called in this process (batchllm.cli.main.main) gets the session's engine of the
    default model instead of loading the model again, when it asks for the default model in float32
    on the CPU (any other request loads as usual). The engine takes the scheduler settings the
    command asked for (policy, step token budget, sequence cap, seed, asynchronous scheduling); its
    KV cache, and so its token limit, stays the session's.
    Gives the EngineConfigs served this way, so a test can check what the command asked for; the
    engine's settings are restored afterwards."""
    import dataclasses

    import batchllm.engines

    build_engine, served = batchllm.engines.build_engine, []

    def build_or_share(config):
        parallel = config.parallel.tensor.size > 1 or config.parallel.ray is not None
        if parallel or not _is_default_model_on_cpu(config):
            return build_engine(config)
        assert config.scheduler.block_size == default_engine.config.scheduler.block_size
        default_engine.configure_scheduler(**{name: getattr(config.scheduler, name) for name in (
            "policy", "max_num_batched_tokens", "max_num_seqs")})
        default_engine.config = dataclasses.replace(default_engine.config, seed=config.seed,
                                                    async_scheduling=config.async_scheduling)
        served.append(config)
        return default_engine

    monkeypatch.setattr(batchllm.engines, "build_engine", build_or_share)
    saved = default_engine.config
    yield served
    default_engine.config = saved  # later tests see the session's settings


@pytest.fixture
def cli_default_tokenizer(session_default_llm, monkeypatch):
    """The default model's tokenizer, as loaded by the session's default engine; the CLI commands
    that only tokenize (`analyze`, `simulate`) get it too when they ask for the default model's
    tokenizer, instead of loading it again (seconds each time). Returns (tokenizer, sources): the
    tokenizer sources those commands asked for, to check."""
    import batchllm.models.tokenizer
    from batchllm.models.default_model import default_model_path

    load_tokenizer, sources = batchllm.models.tokenizer.load_tokenizer, []
    tokenizer = session_default_llm.engine.tokenizer
    default_source = {"kind": "gguf", "path": str(default_model_path())}

    def load_or_share(source):
        sources.append(source)
        return tokenizer if source == default_source else load_tokenizer(source)

    monkeypatch.setattr(batchllm.models.tokenizer, "load_tokenizer", load_or_share)
    return tokenizer, sources
