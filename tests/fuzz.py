"""Example counts of the property-based tests (hypothesis): the count each test runs in CI, times
the BATCHLLM_FUZZ_SCALE environment variable for a longer search. Hypothesis draws new examples
on every run, so a rare failing case can first show up in any CI run; a scaled run finds it
before a change lands (docs/design.md, "Simulating schedules")."""

from __future__ import annotations

import os


def examples(count: int) -> int:
    """`count` examples, times BATCHLLM_FUZZ_SCALE (a positive integer; 1 when unset)."""
    scale = os.environ.get("BATCHLLM_FUZZ_SCALE", "1")
    if not scale.isdigit() or int(scale) < 1:
        raise ValueError(f"BATCHLLM_FUZZ_SCALE must be a positive integer, got {scale!r}")
    return count * int(scale)
