"""Argument checks with clear errors, shared by the planner and the op wrappers (torch-free)."""

from __future__ import annotations


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()
