"""Piecewise CUDA graphs: any step runs as the model's pieces (LlamaForCausalLM.piece: everything
between two attentions, the KV store included), each replayed from a graph captured at start-up
for the step's token bucket, with the step's attention launched eagerly between them (its work
list and dense calls vary per step). docs/design.md, "CUDA graphs"."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from batchllm.engine.attention.paged import PagedAttention
from batchllm.engine.attention.protocol import AttentionBackend, AttentionMetadata
from batchllm.engine.graph_capture import GraphCapture
from batchllm.engine.graph_shapes import bucket_for, token_views
from batchllm.engine.kv_cache import KVCache
from batchllm.engine.step_buffers import StepBuffers
from batchllm.engine.step_inputs import StepInputs
from batchllm.ops.transfer import PinnedStaging


class PiecewiseGraphs:
    """The pieces of every bucket read and write the runner's StepBuffers (a bucket of B tokens their
    first B rows): piece i reads the attention output of layer i - 1, updates the residual stream
    in place and writes layer i's query (after RoPE; its K/V it stores in the cache itself, padding
    rows at slot -1 storing nothing); piece 0 writes the residual stream it starts, the last piece
    the final hidden states over it.

    capture None: the pieces run uncaptured, through the same buffers (the CPU; tests compare it
    with the plain forward)."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, backend: AttentionBackend[Any, Any], scale: float,
                 buffers: StepBuffers, staging: PinnedStaging, buckets: tuple[int, ...],
                 capture: GraphCapture | None) -> None:
        if buckets[-1] > buffers.capacity or buffers.hidden is None:
            raise ValueError(f"piecewise buckets up to {buckets[-1]} tokens need step buffers with activations "
                             f"of at least that many rows, got {buffers.capacity}")
        self.model, self.kv_cache, self.backend, self.scale = model, kv_cache, backend, scale
        self.buffers, self.staging, self.buckets, self.capture = buffers, staging, buckets, capture
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.num_replays = 0  # piece graphs replayed

    def capture_all(self) -> None:
        """Capture every piece of every bucket, the largest bucket first (the shared pool is sized
        by it, and the smaller ones reuse its memory). The buffers hold no step here: input id 0 at
        position 0, no KV stored (slot -1)."""
        if self.capture is None:
            return
        for bucket in reversed(self.buckets):
            input_ids, positions, slot_mapping = token_views(self.buffers.tokens, bucket)
            input_ids.zero_()
            positions.zero_()
            slot_mapping.fill_(-1)
            self.graphs[bucket] = [
                self.capture.capture(self._piece_fn(index, bucket), f"piece {index} of {bucket}-token steps")
                for index in range(self.model.num_pieces)]

    def release(self) -> None:
        for graphs in self.graphs.values():
            for graph in graphs:
                graph.reset()
        self.graphs.clear()

    def bucket(self, num_tokens: int) -> int | None:
        return bucket_for(num_tokens, self.buckets) if num_tokens else None

    def run(self, inputs: StepInputs, host_plan, feed: Callable[[torch.Tensor], None]) -> torch.Tensor | None:
        """Hidden states [num_tokens, hidden] of the step (a view of the buffers, valid until the
        next step), or None when no bucket holds it. host_plan: the backend's build_plan(inputs).
        feed(input_ids) writes the rows fed on the device into the bucket's input ids."""
        num_tokens = inputs.num_tokens
        bucket = self.bucket(num_tokens)
        if bucket is None:
            return None
        graphs = self.graphs.get(bucket)
        if self.capture is not None and graphs is None:
            raise RuntimeError(f"no piecewise graphs were captured for {bucket}-token steps")
        input_ids, positions, slot_mapping = self.buffers.fill_tokens(self.staging, inputs, bucket)
        feed(input_ids)
        plan = self.backend.plan_to_device(host_plan, input_ids.device, self.staging.upload)
        metadata = AttentionMetadata(slot_mapping[:num_tokens], positions[:num_tokens], plan)
        attention = PagedAttention(self.kv_cache, metadata, self.backend, self.scale)
        query = self.buffers.query[:num_tokens]
        attended = self.buffers.attention[:num_tokens].view(query.shape)
        num_layers = self.model.num_pieces - 1
        for index in range(self.model.num_pieces):
            if graphs is None:
                self._piece(index, bucket)
            else:
                graphs[index].replay()
            if index < num_layers:
                attention.attend(index, query, attended)
        self.num_replays += 0 if graphs is None else len(graphs)
        return self.buffers.hidden[:num_tokens]

    def _piece_fn(self, index: int, num_rows: int) -> Callable[[], None]:
        return lambda: self._piece(index, num_rows)

    def _piece(self, index: int, num_rows: int) -> None:
        """Piece `index` on the first num_rows rows of the buffers (what a graph captures)."""
        buffers, model = self.buffers, self.model
        input_ids, positions, slot_mapping = token_views(buffers.tokens, num_rows)
        rope = model.rope_inputs(positions)
        residual = buffers.hidden[:num_rows]
        attention_output = buffers.attention[:num_rows] if index else None
        query = buffers.query[:num_rows] if index < model.num_pieces - 1 else None
        out = model.piece(index, input_ids, rope, attention_output, residual if index else None, query)
        if out.query is not None:
            # Only the store: it needs no plan, and padding rows (slot -1) store nothing.
            store = PagedAttention(self.kv_cache, AttentionMetadata(slot_mapping, positions, None), self.backend,
                                   self.scale)
            store.store(index, out.key, out.value)
        if out.residual is not residual:  # piece 0's embedding, the last piece's final hidden states
            residual.copy_(out.residual)
