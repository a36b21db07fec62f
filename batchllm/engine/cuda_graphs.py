"""CUDA graphs for decode steps (every chunk one row): one graph per rows bucket and block-table
width, each with static buffers (docs/design.md, "CUDA graphs")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from batchllm.attention_plan.layout import graph_layout
from batchllm.attention_plan.work_list import WORK_FIELDS, PrefixSharedPlan
from batchllm.engine.attention.paged import PagedAttention
from batchllm.engine.attention.protocol import AttentionMetadata, GraphAttentionBackend
from batchllm.engine.kv_cache import KVCache
from batchllm.engine.step_inputs import StepInputs
from batchllm.ops.plan_device import PrefixSharedPlanOnDevice

TOKEN_BUCKETS = (8, 16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)


@dataclass(frozen=True)
class GraphKey:
    num_rows: int  # bucket: rows of the graph (> the step's tokens)
    num_blocks: int  # block-table width (power of two)


def rows_bucket(num_tokens: int) -> int | None:
    """Rows of the graph a decode step of num_tokens rows runs in (at least one spare row)."""
    return next((b for b in TOKEN_BUCKETS if num_tokens < b), None)


def graph_items_capacity(num_rows: int) -> int:
    """Work items a graph of num_rows rows holds per list: tiles x KV pieces, see attention_plan/work_list.py."""
    return 4 * num_rows + 1024


class _Graph:
    def __init__(self, key: GraphKey, device: torch.device) -> None:
        rows = key.num_rows
        self.key = key
        self.items_cap = graph_items_capacity(rows)
        self.slots_cap = 8 * rows + 1024  # partial results to merge
        # int64 part: input_ids, positions, slot_mapping
        self.dev64 = torch.zeros(3 * rows, dtype=torch.int64, device=device)
        # int32 part: the plan's arrays (attention_plan.layout.graph_layout). The attention launches are
        # persistent: each runs the first num_items[i] items of its padded list.
        self.layout = graph_layout(rows, key.num_blocks, self.items_cap, self.slots_cap, WORK_FIELDS)
        self.dev32 = torch.zeros(self.layout.num_int32, dtype=torch.int32, device=device)
        # Two pinned host copies, used in turn: with asynchronous scheduling the host fills step
        # N+1's while step N's copy may still be queued behind step N-1 on the stream. Each has
        # an event recorded after its copy; waiting on it is a safety net that never blocks with
        # one step in flight (step N-1 has been synced before step N+1 is filled).
        self._host64 = [torch.zeros(3 * rows, dtype=torch.int64).pin_memory() for _ in range(2)]
        self._host32 = [torch.zeros(self.layout.num_int32, dtype=torch.int32).pin_memory() for _ in range(2)]
        self._host64_np = [host.numpy() for host in self._host64]
        self._host32_views = [self.layout.views(host.numpy()) for host in self._host32]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: torch.Tensor | None = None

    def fits(self, plan: PrefixSharedPlan, lists: tuple[np.ndarray, np.ndarray]) -> bool:
        """lists: plan.class_lists()."""
        return (max(items.shape[0] for items in lists) <= self.items_cap
                and plan.num_partial_slots <= self.slots_cap and plan.merge_tokens.shape[0] < self.key.num_rows
                and plan.dense.shape[0] == 0)  # dense calls are host-launched per step (none in decode plans)

    def fill(self, plan: PrefixSharedPlan, lists: tuple[np.ndarray, np.ndarray], inputs: StepInputs) -> None:
        """lists: plan.class_lists(), the work list(s) as the graph's launches take them."""
        turn = self._turn
        self._turn = 1 - turn
        copied = self._copied[turn]
        if copied is not None and not copied.query():
            copied.synchronize()
        rows, num_tokens = self.key.num_rows, inputs.num_tokens
        ids = self._host64_np[turn]
        ids[:] = 0
        ids[2 * rows:] = -1  # padding rows store no KV (their outputs are never sampled)
        ids[:num_tokens] = inputs.input_ids
        ids[rows:rows + num_tokens] = inputs.positions
        ids[2 * rows:2 * rows + num_tokens] = inputs.slot_mapping
        host = self._host32_views[turn]
        for name, items, index in (("work", lists[0], 0), ("work_small", lists[1], 1)):
            host["num_items"][index] = items.shape[0]
            host[name][:items.shape[0]] = items  # (the persistent launch never reads past num_items)
        tables = host["block_tables"]
        tables[:] = 0
        tables[:plan.block_tables.shape[0], :plan.block_tables.shape[1]] = plan.block_tables
        host["prefix_limit"][:] = 0
        host["prefix_limit"][:num_tokens] = plan.prefix_limit
        num_merge = plan.merge_tokens.shape[0]
        host["merge_tokens"][:] = rows - 1  # the spare row absorbs the padded merges
        host["merge_tokens"][:num_merge] = plan.merge_tokens
        host["merge_offsets"][:] = plan.num_partial_slots
        host["merge_offsets"][:num_merge + 1] = plan.merge_offsets
        host["merge_slots"][:] = 0
        host["merge_slots"][:plan.num_partial_slots] = plan.merge_slots
        self.dev64.copy_(self._host64[turn], non_blocking=True)
        self.dev32.copy_(self._host32[turn], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copied[turn] = event

    def device_plan(self, template: PrefixSharedPlan, num_sms: int) -> PrefixSharedPlanOnDevice:
        """A PrefixSharedPlanOnDevice over the static buffers, shaped like the graph; its attention
        launch is persistent (the grid is frozen at capture, the step's item count is not)."""
        views = self.layout.views(self.dev32)
        split = template.tile.split_classes
        return PrefixSharedPlanOnDevice(
            work=views["work"], block_tables=views["block_tables"], prefix_limit=views["prefix_limit"],
            merge_tokens=views["merge_tokens"], merge_offsets=views["merge_offsets"],
            merge_slots=views["merge_slots"], work_big=views["work"] if split else None,
            work_small=views["work_small"] if split else None, num_partial_slots=self.slots_cap,
            num_tokens=self.key.num_rows, num_heads=template.num_heads, num_kv_heads=template.num_kv_heads,
            block_size=template.block_size, tile=template.tile, num_items=views["num_items"],
            persistent_programs=num_sms * template.tile.graph_programs_per_sm)


class DecodeGraphRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, backend: GraphAttentionBackend, scale: float,
                 device: torch.device) -> None:
        self.model, self.kv_cache, self.backend, self.scale, self.device = model, kv_cache, backend, scale, device
        self.graphs: dict[GraphKey, _Graph] = {}
        self.num_replays = 0

    def release(self) -> None:
        """Destroy the captured graphs now (after the device has finished replaying them). A
        graph that captured NCCL collectives keeps the communicator busy: tearing the process
        group down before its graphs are gone hangs."""
        torch.cuda.synchronize(self.device)
        for graph in self.graphs.values():
            if graph.graph is not None:
                graph.graph.reset()
        self.graphs.clear()

    def key_for(self, inputs: StepInputs) -> GraphKey | None:
        """The graph of a decode step (None: not a decode step, or too many rows)."""
        if inputs.num_tokens == 0 or not inputs.decode_only:
            return None
        rows = rows_bucket(inputs.num_tokens)
        if rows is None:
            return None
        width = 1 << max(int(inputs.block_tables.shape[1]) - 1, 0).bit_length()
        return GraphKey(rows, max(width, 16))

    def run(self, inputs: StepInputs, plan: PrefixSharedPlan,
            feed: Callable[[torch.Tensor], None]) -> torch.Tensor | None:
        """Hidden states [num_tokens, hidden] of a decode step via a graph, or None (run eagerly).
        feed(input_ids): writes the rows fed on the device (the last-token column) into the
        graph's static input ids, after the host's copy and before the replay, on the stream."""
        key = self.key_for(inputs)
        if key is None:
            return None
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = _Graph(key, self.device)
        lists = plan.class_lists()
        if not graph.fits(plan, lists):
            return None
        graph.fill(plan, lists, inputs)
        feed(graph.dev64[:graph.key.num_rows])
        if graph.graph is None:
            self._capture(graph, plan)
        graph.graph.replay()
        self.num_replays += 1
        return graph.hidden[:inputs.num_tokens]

    def _capture(self, graph: _Graph, template_plan: PrefixSharedPlan) -> None:
        rows = graph.key.num_rows
        input_ids, positions, slot_mapping = graph.dev64[:rows], graph.dev64[rows:2 * rows], graph.dev64[2 * rows:]
        metadata = AttentionMetadata(slot_mapping=slot_mapping, positions=positions,
                                     plan=graph.device_plan(template_plan, self.backend.num_sms))
        # An FP8 cache's k_scale / v_scale reach the kernels as launch arguments: the graph keeps
        # the values of its capture, constants of the cache.
        attention = PagedAttention(self.kv_cache, metadata, self.backend, self.scale)
        # Warm up on a side stream (Triton compiles, allocator settles), then capture. The
        # buffers hold the current step, so the warm-up writes the same KV the replay will.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.model(input_ids, positions, attention)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            graph.hidden = self.model(input_ids, positions, attention)
        graph.graph = cuda_graph
