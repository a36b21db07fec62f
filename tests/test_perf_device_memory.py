"""The caching allocator's counters that bench rows report (perf/device_memory.py)."""

import torch

from batchllm.perf.device_memory import allocator_counts, allocator_counts_since


def test_allocator_counts_are_empty_off_cuda():
    assert allocator_counts(torch.device("cpu")) == {}
    assert allocator_counts_since(torch.device("cpu"), {}) == {}


def test_allocator_counts_name_retries_mallocs_and_frees_since_a_start(monkeypatch):
    stats = {"num_alloc_retries": 2, "num_device_alloc": 40, "num_device_free": 7, "num_ooms": 0}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: dict(stats))
    cuda = torch.device("cuda", 0)
    before = allocator_counts(cuda)
    assert before == {"allocator_retries": 2, "device_mallocs": 40, "device_frees": 7}
    stats.update(num_alloc_retries=5, num_device_alloc=41, num_device_free=19)
    assert allocator_counts_since(cuda, before) == {"allocator_retries": 3, "device_mallocs": 1, "device_frees": 12}


def test_allocator_counts_read_a_missing_counter_as_zero(monkeypatch):
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {"num_alloc_retries": 1})
    assert allocator_counts(torch.device("cuda")) == {"allocator_retries": 1, "device_mallocs": 0, "device_frees": 0}
