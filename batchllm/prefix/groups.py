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


def write_groups_jsonl(plan: PrefixPlan, custom_ids: Sequence[str], stream: TextIO) -> int:
    """Write one group per line (custom_ids[i] names input request i); returns the number of lines."""
    if len(set(custom_ids)) != len(custom_ids):
        raise ValueError("custom_ids must be unique")
    for group in plan.groups:
        requests = [{"custom_id": custom_ids[index], "distinct_token_ids": list(distinct)}
                    for index, distinct in zip(group.request_indices, group.distinct_token_ids)]
        record = {"prefix_token_ids": list(group.prefix_token_ids), "requests": requests}
        stream.write(json.dumps(record, separators=(",", ":")))
        stream.write("\n")
    return len(plan.groups)
