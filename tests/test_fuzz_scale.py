"""The example counts of the property-based tests scale with BATCHLLM_FUZZ_SCALE."""

import pytest

from fuzz import examples


def test_examples_scale_with_the_environment(monkeypatch):
    monkeypatch.delenv("BATCHLLM_FUZZ_SCALE", raising=False)
    assert examples(200) == 200
    monkeypatch.setenv("BATCHLLM_FUZZ_SCALE", "150")
    assert examples(200) == 30_000
    for bad in ("0", "-3", "1.5", "many"):
        monkeypatch.setenv("BATCHLLM_FUZZ_SCALE", bad)
        with pytest.raises(ValueError, match="positive integer"):
            examples(200)
