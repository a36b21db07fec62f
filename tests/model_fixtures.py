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
engine (`engine.configure_scheduler(...)`, `engine.async_scheduling`, ...) are restored after it,
so tests reconfigure them freely between runs. `session_default_llm` and `session_tiny_engine`
are the session objects themselves, for module- or session-scoped fixtures that only run them
(never reconfigure). A test that needs another model, KV cache size or attention backend builds
its own engine.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from model_helpers import default_gguf_path

DEFAULT_KV_CACHE_TOKENS = 4096  # the shared default engine's KV cache (token limit 4080)


@pytest.fixture(scope="session")
def default_model():
    """Our LoadedModel of the default GGUF (SmolLM2-135M-Instruct Q4_1), float32 on CPU."""
    from batchllm.models import load_model

    return load_model(str(default_gguf_path()), dtype=torch.float32, device="cpu")


@pytest.fixture(scope="session")
def hf_default_model():
    """transformers' AutoModelForCausalLM of the same GGUF, float32 on CPU, eval mode."""
    from transformers import AutoModelForCausalLM

    path = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


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
    from batchllm.config import EngineConfig
    from batchllm.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model="random:tiny", dtype="float32", device="cpu", kv_cache_tokens=4096))


@pytest.fixture
def tiny_engine(session_tiny_engine):
    """The session's LLMEngine of random:tiny (float32, CPU, 4096 KV tokens); settings restored after."""
    with _settings_restored(session_tiny_engine):
        yield session_tiny_engine
