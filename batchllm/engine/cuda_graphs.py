"""Whole-step CUDA graphs for decode steps (every chunk one row), attention included: one graph per
rows bucket, block-table width and attention (the work-list kernels, or XQA for steps whose rows share
no KV: ops/xqa_decode.py), captured on first use (docs/design.md, "CUDA graphs")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from batchllm.attention_plan.layout import graph_layout
from batchllm.attention_plan.work_list import WORK_FIELDS, PrefixSharedPlan
from batchllm.engine.attention.paged import PagedAttention
from batchllm.engine.attention.protocol import AttentionMetadata, GraphAttentionBackend
from batchllm.engine.graph_capture import GraphCapture
from batchllm.engine.graph_shapes import (block_table_width, decode_plan_fits, decode_rows_bucket, fill_decode_plan,
                                          graph_items_capacity, graph_slots_capacity)
from batchllm.engine.kv_cache import KVCache
from batchllm.engine.step_buffers import StepBuffers
from batchllm.engine.step_inputs import StepInputs
from batchllm.ops.plan_device import PrefixSharedPlanOnDevice
from batchllm.ops.transfer import PinnedStaging


@dataclass(frozen=True)
class GraphKey:
    num_rows: int  # bucket: rows of the graph (> the step's tokens)
    num_blocks: int  # block-table width (power of two)
    xqa: bool = False  # its attention is XQA's (the plan's lead rows are all its rows): replays only such steps


class _Graph:
    """One decode graph: its static plan buffer (the int32 arrays of graph_layout) and the graph.
    Its rows' tokens and its hidden states live in the runner's StepBuffers."""

    def __init__(self, key: GraphKey, device: torch.device) -> None:
        rows = key.num_rows
        self.key = key
        # The attention launches are persistent: each runs the first num_items[i] items of its padded list.
        self.layout = graph_layout(rows, key.num_blocks, graph_items_capacity(rows), graph_slots_capacity(rows),
                                   WORK_FIELDS)
        self.plan32 = torch.zeros(self.layout.num_int32, dtype=torch.int32, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None

    def fill(self, staging: PinnedStaging, plan: PrefixSharedPlan, lists: tuple[np.ndarray, np.ndarray],
             num_tokens: int) -> None:
        """lists: plan.class_lists(), the work list(s) as the graph's launches take them."""
        staged = staging.stage(self.layout.num_int32, np.int32)
        fill_decode_plan(self.layout.views(staged.array), plan, lists, self.key.num_rows, num_tokens)
        staging.copy(staged, self.plan32)

    def device_plan(self, template: PrefixSharedPlan, num_sms: int) -> PrefixSharedPlanOnDevice:
        """A PrefixSharedPlanOnDevice over the static buffer, shaped like the graph; its attention
        launch is persistent (the grid is frozen at capture, the step's item count is not)."""
        views = self.layout.views(self.plan32)
        split = template.tile.split_classes
        return PrefixSharedPlanOnDevice(
            work=views["work"], block_tables=views["block_tables"], prefix_limit=views["prefix_limit"],
            merge_tokens=views["merge_tokens"], merge_offsets=views["merge_offsets"],
            merge_slots=views["merge_slots"], work_big=views["work"] if split else None,
            work_small=views["work_small"] if split else None,
            num_partial_slots=graph_slots_capacity(self.key.num_rows),
            num_tokens=self.key.num_rows, num_heads=template.num_heads, num_kv_heads=template.num_kv_heads,
            block_size=template.block_size, tile=template.tile, num_items=views["num_items"],
            persistent_programs=num_sms * template.tile.graph_programs_per_sm,
            lead_seq_lens=views["seq_lens"] if self.key.xqa else None)


class DecodeGraphRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, backend: GraphAttentionBackend, scale: float,
                 buffers: StepBuffers, staging: PinnedStaging, capture: GraphCapture) -> None:
        self.model, self.kv_cache, self.backend, self.scale = model, kv_cache, backend, scale
        self.buffers, self.staging, self.capture = buffers, staging, capture
        self.graphs: dict[GraphKey, _Graph] = {}
        self.num_replays = 0

    def release(self) -> None:
        """Destroy the captured graphs (after the device has finished replaying them)."""
        for graph in self.graphs.values():
            if graph.graph is not None:
                graph.graph.reset()
        self.graphs.clear()

    def key_for(self, inputs: StepInputs, plan: PrefixSharedPlan) -> GraphKey | None:
        """The graph of a decode step and its plan (None: not a decode step, or too many rows); an XQA
        graph where the plan leaves its rows to XQA (PrefixSharedPlan.lead_seq_lens)."""
        if inputs.num_tokens == 0 or not inputs.decode_only:
            return None
        rows = decode_rows_bucket(inputs.num_tokens)
        if rows is None or rows > self.buffers.capacity:
            return None
        return GraphKey(rows, block_table_width(int(inputs.block_tables.shape[1])), bool(plan.lead_seq_lens.size))

    def run(self, inputs: StepInputs, plan: PrefixSharedPlan,
            feed: Callable[[torch.Tensor], None]) -> torch.Tensor | None:
        """Hidden states [num_tokens, hidden] of a decode step via a graph, or None (not a decode step,
        or one that fits no graph). feed(input_ids): writes the rows fed on the device (the
        last-token column) into the graph's static input ids, after the host's copy and before
        the replay, on the stream."""
        key = self.key_for(inputs, plan)
        if key is None:
            return None
        lists = plan.class_lists()
        if not decode_plan_fits(plan, lists, key.num_rows, key.num_blocks):
            return None
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = _Graph(key, self.buffers.tokens.device)
        input_ids, positions, slot_mapping = self.buffers.fill_tokens(self.staging, inputs, key.num_rows)
        graph.fill(self.staging, plan, lists, inputs.num_tokens)
        feed(input_ids)
        if graph.graph is None:
            self._capture(graph, plan, input_ids, positions, slot_mapping)
        graph.graph.replay()
        self.num_replays += 1
        return self.buffers.hidden[:inputs.num_tokens]

    def _capture(self, graph: _Graph, template_plan: PrefixSharedPlan, input_ids: torch.Tensor,
                 positions: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        rows = graph.key.num_rows
        metadata = AttentionMetadata(slot_mapping=slot_mapping, positions=positions,
                                     plan=graph.device_plan(template_plan, self.backend.num_sms))
        # An FP8 cache's k_scale / v_scale reach the kernels as launch arguments: the graph keeps
        # the values of its capture, constants of the cache.
        attention = PagedAttention(self.kv_cache, metadata, self.backend, self.scale)
        hidden = self.buffers.hidden[:rows]

        def forward() -> None:
            hidden.copy_(self.model(input_ids, positions, attention))

        # The buffers hold the current step, so the warm-up writes the same KV the replay will.
        graph.graph = self.capture.capture(forward, f"decode steps of {rows} rows")
