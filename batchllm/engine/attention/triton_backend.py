"""The `triton` and `fused` attention backends: the Triton work-list kernels (ops/prefix_attention.py)
over a host-built work list (attention_plan/). `fused` (BatchLLM section 5) gives the work list the
step's prefix-sharing groups: prefix tiles (a group's rows x its shared prefix KV, a MatMul) and
distinct tiles in one launch. `triton` is plain paged attention (what the vllm / sglang baseline
policies run): every seq reads its whole block table, no knowledge of groups. `xqa` is `fused` whose
decode rows that share no KV attend by XQA (ops/xqa_decode.py; TritonBackend.xqa_rows)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from batchllm.attention_plan.tile_config import TileConfig, decode_tile_config, prefill_tile_config
from batchllm.attention_plan.work_list import PrefixSharedPlan, build_prefix_shared_plan
from batchllm.engine.attention.protocol import AttentionMetadata
from batchllm.engine.step_inputs import StepInputs
from batchllm.ops.plan_device import PrefixSharedPlanOnDevice, device_num_sms, plan_to_device
from batchllm.ops.transfer import Upload
from batchllm.ops.xqa_decode import XqaDecode

if TYPE_CHECKING:
    from batchllm.ops.fa3_dense import Fa3Dense


class TritonBackend:
    supports_cuda_graphs = True

    def __init__(self, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
                 uses_groups: bool, layer_windows: tuple[int | None, ...] = (), kv_fp8: bool = False,
                 xqa: XqaDecode | None = None, fa3_dense: Fa3Dense | None = None) -> None:
        """uses_groups: whether the work list knows the step's prefix-sharing groups (`fused`).
        kv_fp8: the KV cache is float8_e4m3fn (decode steps get that cache's tiles).
        xqa: the decode rows that share no KV attend by it (`xqa`; FP8 caches; xqa_rows).
        fa3_dense: the dense calls of steps with prefill chunks run on it, in FP8 products (`xqa`
        on Hopper): causal calls from the dense calls' least rows, each holding its chunk's
        context under FA3's bottom-right mask, and every call over its whole KV range, since FA3
        takes any lengths in one launch."""
        # The kernels' modules import Triton: loaded with a backend that runs them, once.
        from batchllm.ops.kv_store import store_kv
        from batchllm.ops.prefix_attention import prefix_shared_attention

        self._store_kv, self._attention = store_kv, prefix_shared_attention
        self.block_size, self.num_heads, self.num_kv_heads = block_size, num_heads, num_kv_heads
        self.head_dim, self.device, self.uses_groups = head_dim, device, uses_groups
        self.layer_windows = tuple(layer_windows)
        self.xqa, self.fa3_dense = xqa, fa3_dense
        self.num_sms = device_num_sms(device)  # split-KV pieces fill the device; CUDA graphs size their grids
        group_size = num_heads // num_kv_heads
        # Decode-only steps (one row per seq: the CUDA-graph steps) run class-split launches with the
        # tiles of the cache's dtype; steps with prefill chunks the prefill table of the cache's
        # dtype, without dense calls for a model with a sliding window (dense calls have no
        # sliding-window path).
        self.decode_tile = decode_tile_config(head_dim, group_size, kv_fp8=kv_fp8)
        self.prefill_tile: TileConfig = prefill_tile_config(head_dim, group_size, kv_fp8=kv_fp8)
        if any(window is not None for window in self.layer_windows):
            self.prefill_tile = replace(self.prefill_tile, dense_min_rows=0)
        elif fa3_dense is not None:
            self.prefill_tile = replace(self.prefill_tile, dense_causal_min_rows=self.prefill_tile.dense_min_rows,
                                        dense_any_size=True, dense_causal_whole=True)
        # decode steps run their BIG and SMALL launches concurrently, the BIG one on this stream
        self.side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def build_plan(self, inputs: StepInputs) -> PrefixSharedPlan:
        """The step's work list on the host (numpy); one per step, shared by every layer. With XQA,
        the rows it attends (xqa_rows) are left out of the work list."""
        tile = self.decode_tile if inputs.decode_only else self.prefill_tile  # decode tiles make no dense calls
        groups = (inputs.group_ids, inputs.is_prefix) if self.uses_groups else (None, None)
        # a decode step's split-KV pieces fill the programs of its graph's persistent launches
        programs = {"programs_per_sm": self.decode_tile.graph_programs_per_sm} if inputs.decode_only else {}
        return build_prefix_shared_plan(
            inputs.query_start_loc, inputs.seq_lens, inputs.shared_kv_lens, inputs.block_tables, *groups,
            block_size=self.block_size, num_kv_heads=self.num_kv_heads, num_heads=self.num_heads,
            head_dim=self.head_dim, tile=tile, num_sms=self.num_sms, num_lead_rows=self.xqa_rows(inputs), **programs,
        )

    def xqa_rows(self, inputs: StepInputs) -> int:
        """How many of the step's first rows XQA attends: every row of a decode step that decode_by_xqa
        takes (its graph runs XQA alone), none of any other decode step (its graph runs the work
        list alone); in a step with prefill chunks, the leading run of one-row chunks that share no
        KV (the batchllm policy lays decode rows out first), beside the work list's launches."""
        if self.xqa is None:
            return 0
        if inputs.decode_only:
            return int(inputs.seq_lens.shape[0]) if self.decode_by_xqa(inputs) else 0
        num_rows = np.diff(inputs.query_start_loc)
        lone = (num_rows == 1) & (inputs.shared_kv_lens == 0) & ~inputs.is_prefix
        return int(lone.size if lone.all() else np.argmin(lone))

    def decode_by_xqa(self, inputs: StepInputs) -> bool:
        """XQA reads each row's KV through its own block table, position p in block p // block_size:
        a step whose rows share no KV (no group prefix, no shared blocks) is laid out that way, and
        nothing is read twice that the work list would read once."""
        return self.xqa is not None and not inputs.shared_kv_lens.any()

    def plan_to_device(self, plan: PrefixSharedPlan, device: torch.device,
                       upload: Upload | None = None) -> PrefixSharedPlanOnDevice:
        on_device = plan_to_device(plan, device, upload)
        if self.fa3_dense is not None and on_device.dense:
            on_device.dense_runner = self.fa3_dense.prepare(on_device.dense, upload)
        return on_device

    def store(self, key, value, k_cache, v_cache, metadata: AttentionMetadata, k_scale: float = 1.0,
              v_scale: float = 1.0) -> None:
        self._store_kv(key, value, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale)

    def attend(self, query, k_cache, v_cache, metadata: AttentionMetadata[PrefixSharedPlanOnDevice], scale: float,
               window: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
               out: torch.Tensor | None = None) -> torch.Tensor:
        plan = metadata.plan
        if plan.lead_seq_lens is None:
            return self._attention(query, k_cache, v_cache, plan, scale, window, metadata.positions, k_scale, v_scale,
                                   self.side_stream, out)
        # XQA's rows (xqa_rows) lead the step, one per seq: seq i is row i
        assert self.xqa is not None and window is None
        num_lead = plan.lead_seq_lens.shape[0]
        out = torch.empty_like(query) if out is None else out

        def lead_rows() -> None:
            self.xqa(query[:num_lead], k_cache, v_cache, plan.block_tables[:num_lead], plan.lead_seq_lens, scale,
                     k_scale, v_scale, out[:num_lead])

        if num_lead == query.shape[0]:  # an XQA decode graph, or a decode step all of whose rows it takes
            lead_rows()
            return out
        return self._attention(query, k_cache, v_cache, plan, scale, window, metadata.positions, k_scale, v_scale,
                               self.side_stream, out, beside=lead_rows)
