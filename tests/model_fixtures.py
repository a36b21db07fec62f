"""Session fixtures for model tests, shared through pytest's plugin mechanism.

Use from any test module (tests/ is on sys.path under pytest's default import mode):

    pytest_plugins = ["model_fixtures"]

Registered as a plugin, each fixture exists once per session (importing the fixture functions
into several modules instead would load the models once per module). Helpers (reference
attention, flat-batch runner) live in tests/model_helpers.py.
"""

from __future__ import annotations

import pytest
import torch

from model_helpers import default_gguf_path


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
