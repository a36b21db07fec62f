"""Global prefix planning (BatchLLM 4.2): compact prefix tree -> optimal single-level groups.
Torch-free by contract (a test imports this package with torch blocked)."""

from batchllm.prefix.groups import PrefixGroup, PrefixPlan, write_groups_jsonl
from batchllm.prefix.keys import PromptError
from batchllm.prefix.optimal import PrefixTreeTooDeepError
from batchllm.prefix.planner import PlanArrays, plan_prefix_arrays, plan_prefix_groups, plan_prefix_token_arrays
from batchllm.prefix.stats import Distribution, PlanStats

__all__ = [
    "Distribution",
    "PlanArrays",
    "PlanStats",
    "PrefixGroup",
    "PrefixPlan",
    "PrefixTreeTooDeepError",
    "PromptError",
    "plan_prefix_arrays",
    "plan_prefix_token_arrays",
    "plan_prefix_groups",
    "write_groups_jsonl",
]
