"""Plain paged attention for mixed prefill/decode batches, without prefix sharing: what the
vllm/sglang baseline policies run. The same Triton kernel as the fused one, fed a work list that
knows nothing about groups: each request reads its whole KV [0, seq_len) itself.
"""

from __future__ import annotations

from batchllm.ops.work_list import PrefixSharedPlan, build_prefix_shared_plan


def build_paged_plan(query_start_loc, seq_lens, shared_kv_lens, block_tables, **kwargs) -> PrefixSharedPlan:
    """Work list of a batch without sharing knowledge (host numpy; the keyword arguments of
    build_prefix_shared_plan); run it with prefix_attention.prefix_shared_attention after `.to(device)`."""
    return build_prefix_shared_plan(query_start_loc, seq_lens, shared_kv_lens, block_tables, **kwargs)
