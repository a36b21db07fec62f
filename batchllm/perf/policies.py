"""Policy labels of a benchmark run: 'NAME[@TOKENS | @SEQS/TOKENS][+eager][+sync]'. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

POLICY_NAMES = ("batchllm", "vllm", "sglang", "simple")
FLAGS = ("eager", "sync")


@dataclass(frozen=True)
class PolicySpec:
    label: str  # as written, the row's "policy"
    name: str  # scheduling policy
    changes: dict  # engine.configure_scheduler(**changes)
    flags: frozenset  # "eager": no CUDA graphs; "sync": no asynchronous scheduling


def parse_policy(text: str) -> PolicySpec:
    """'vllm@1024/16384' -> vllm with max_num_seqs 1024, max_num_batched_tokens 16384;
    'batchllm@8192' -> token budget 8192. Suffixes: '+eager' runs without CUDA graphs, '+sync'
    without asynchronous scheduling (one step at a time)."""
    text = text.strip()
    flags, base = set(), text
    while flag := next((f for f in FLAGS if base.endswith("+" + f)), None):  # the suffixes in any order
        flags.add(flag)
        base = base.removesuffix("+" + flag)
    name, _, setting = base.partition("@")
    if name not in POLICY_NAMES:
        raise ValueError(f"unknown policy {name!r} in {text!r}: one of {', '.join(POLICY_NAMES)}, "
                         "optionally @TOKENS or @SEQS/TOKENS and +eager / +sync")
    changes: dict = {"policy": name}
    if setting:
        try:
            numbers = [int(part) for part in setting.split("/")]
        except ValueError:
            numbers = []
        if not 1 <= len(numbers) <= 2:
            raise ValueError(f"bad policy setting in {text!r}: NAME@TOKENS or NAME@SEQS/TOKENS")
        changes.update(zip(("max_num_seqs", "max_num_batched_tokens")[-len(numbers):], numbers))
    return PolicySpec(text, name, changes, frozenset(flags))


def parse_policies(text: str) -> list[PolicySpec]:
    specs = [parse_policy(part) for part in text.split(",") if part.strip()]
    if not specs:
        raise ValueError("no policy given (e.g. --policies batchllm,vllm)")
    return specs
