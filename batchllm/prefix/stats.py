"""Plan statistics: prefill tokens and saving ratios (BatchLLM Eq. 2, section 6.2.2)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from batchllm.prefix.tree import CompactPrefixTree


@dataclass(frozen=True)
class Distribution:
    """Summary of a list of non-negative numbers (zeros when empty)."""

    count: int
    min: float
    mean: float
    p50: float
    p90: float
    max: float

    @staticmethod
    def of(values: np.ndarray) -> "Distribution":
        values = np.asarray(values, dtype=np.float64)
        if values.size == 0:
            return Distribution(0, 0.0, 0.0, 0.0, 0.0, 0.0)
        return Distribution(
            count=int(values.size),
            min=float(values.min()),
            mean=float(values.mean()),
            p50=float(np.percentile(values, 50)),
            p90=float(np.percentile(values, 90)),
            max=float(values.max()),
        )


@dataclass(frozen=True)
class PlanStats:
    """Logical vs processed prefill tokens for four ways of sharing, plus group shapes; saving ratio
    (Eq. 2) = (logical - processed) / logical prefill tokens."""

    num_requests: int
    logical_prefill_tokens: int  # sum of prompt lengths; also processed with no sharing
    processed_prefill_tokens: int  # (a) optimal single-level plan
    processed_prefill_tokens_multi_level: int  # (b) every shared tree node computed once
    processed_prefill_tokens_naive_first_level: int  # (c) group by the root's children
    num_groups: int  # groups including singletons
    num_shared_groups: int  # groups of >= 2 requests
    num_singletons: int
    sharing_degree: Distribution  # requests per shared group
    prefix_num_tokens: Distribution  # prefix length per shared group
    planning_seconds: float

    @property
    def saved_prefill_tokens(self) -> int:
        return self.logical_prefill_tokens - self.processed_prefill_tokens

    def _ratio(self, processed: int) -> float:
        logical = self.logical_prefill_tokens
        return (logical - processed) / logical if logical else 0.0

    @property
    def saving_ratio(self) -> float:
        return self._ratio(self.processed_prefill_tokens)

    @property
    def saving_ratio_multi_level(self) -> float:
        return self._ratio(self.processed_prefill_tokens_multi_level)

    @property
    def saving_ratio_naive_first_level(self) -> float:
        return self._ratio(self.processed_prefill_tokens_naive_first_level)

    @property
    def saving_ratio_no_sharing(self) -> float:
        return 0.0

    def to_dict(self) -> dict:
        """Flat JSON-ready dict (fields plus ratios)."""
        properties = ("saved_prefill_tokens", "saving_ratio", "saving_ratio_multi_level",
                      "saving_ratio_naive_first_level", "saving_ratio_no_sharing")
        return {**asdict(self), **{name: getattr(self, name) for name in properties}}


def build_stats(
    tree: CompactPrefixTree,
    prompt_num_tokens: np.ndarray,
    saved_num_tokens: int,
    group_sizes: np.ndarray,
    group_prefix_num_tokens: np.ndarray,
    planning_seconds: float,
) -> PlanStats:
    num_requests = int(prompt_num_tokens.size)
    logical = int(prompt_num_tokens.sum())
    # multi-level: the keys' tokens minus the compact tree's (each tree token computed once)
    edges = tree.depth_num_tokens[1:] - tree.depth_num_tokens[tree.parent[1:]]
    multi_level_saved = logical - num_requests - int(edges.sum())
    # naive: group by the root's children (the paper's first-level prefixes, Fig. 4a)
    first_level = np.flatnonzero(tree.parent == 0)
    naive_saved = int(((tree.subtree_num_keys()[first_level] - 1) * tree.depth_num_tokens[first_level]).sum())
    shared = group_sizes >= 2
    return PlanStats(
        num_requests=num_requests,
        logical_prefill_tokens=logical,
        processed_prefill_tokens=logical - saved_num_tokens,
        processed_prefill_tokens_multi_level=logical - multi_level_saved,
        processed_prefill_tokens_naive_first_level=logical - naive_saved,
        num_groups=int(group_sizes.size),
        num_shared_groups=int(shared.sum()),
        num_singletons=int((~shared).sum()),
        sharing_degree=Distribution.of(group_sizes[shared]),
        prefix_num_tokens=Distribution.of(group_prefix_num_tokens[shared]),
        planning_seconds=planning_seconds,
    )
