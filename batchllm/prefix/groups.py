"""Prefix-sharing groups: the planner's output contract (BatchLLM 4.2, the paper's tuple
(prefix_token_ids, [distinct_token_ids per request]))."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence, TextIO

if TYPE_CHECKING:
    from batchllm.prefix.stats import PlanStats


@dataclass(frozen=True)
class PrefixGroup:
    """Requests that share one prefix; its KV is computed and stored once."""

    prefix_token_ids: tuple[int, ...]  # empty for a group of size 1 (singletons share nothing)
    request_indices: tuple[int, ...]  # indices into the planner's input list, ascending
    distinct_token_ids: tuple[tuple[int, ...], ...]  # per request (same order), >= 1 token each

    @property
    def num_requests(self) -> int:
        return len(self.request_indices)

    @property
    def prefix_num_tokens(self) -> int:
        return len(self.prefix_token_ids)

    @property
    def saved_num_tokens(self) -> int:
        """Prefill tokens not recomputed thanks to sharing: (|g| - 1) * len(prefix)."""
        return (len(self.request_indices) - 1) * len(self.prefix_token_ids)


@dataclass(frozen=True)
class PrefixPlan:
    groups: tuple[PrefixGroup, ...]  # every input index in exactly one group
    stats: "PlanStats"

    @property
    def saved_num_tokens(self) -> int:
        return sum(group.saved_num_tokens for group in self.groups)


def group_to_json_dict(group: PrefixGroup, custom_ids: Sequence[str]) -> dict:
    """One JSONL record; custom_ids[i] names input request i."""
    return {
        "prefix_token_ids": list(group.prefix_token_ids),
        "requests": [
            {"custom_id": custom_ids[index], "distinct_token_ids": list(distinct)}
            for index, distinct in zip(group.request_indices, group.distinct_token_ids)
        ],
    }


def write_groups_jsonl(plan: PrefixPlan, custom_ids: Sequence[str], stream: TextIO) -> int:
    """Write one group per line; returns the number of lines written."""
    if len(set(custom_ids)) != len(custom_ids):
        raise ValueError("custom_ids must be unique")
    num_lines = 0
    for group in plan.groups:
        stream.write(json.dumps(group_to_json_dict(group, custom_ids), separators=(",", ":")))
        stream.write("\n")
        num_lines += 1
    return num_lines


def read_groups_jsonl(stream: TextIO) -> list[dict]:
    """Inverse of write_groups_jsonl (records as dicts), for tools and tests."""
    return [json.loads(line) for line in stream if line.strip()]
