"""The device tensors a step's inputs and a CUDA graph's activations live in, sized once for the
largest step: a step of T rows uses their first T rows, so memory does not grow with the number
of graphs (docs/design.md, "CUDA graphs")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchllm.engine.graph_shapes import stage_tokens, token_stride, token_views
from batchllm.engine.step_inputs import StepInputs
from batchllm.ops.transfer import PinnedStaging


@dataclass(frozen=True)
class ActivationShape:
    """The widths of the activations that cross a graph's edges."""

    hidden_size: int
    num_heads: int  # query heads (a tensor-parallel shard's)
    head_dim: int
    dtype: torch.dtype

    def bytes_per_row(self) -> int:
        """query + attention output + hidden state of one row."""
        return (2 * self.num_heads * self.head_dim + self.hidden_size) * self.dtype.itemsize


class StepBuffers:
    """tokens: the step's input ids, positions and KV slots (graph_shapes.token_views), for every
    step of at most `capacity` rows, eager or graphed. With `activations`, the tensors between a
    graph and the work around it: the query after RoPE ([capacity, num_heads, head_dim], what the
    eager attention reads), the attention output ([capacity, num_heads * head_dim], what the next
    piece reads) and the hidden state ([capacity, hidden_size]: the residual stream between pieces,
    then the final hidden states, also of the decode graphs)."""

    def __init__(self, capacity: int, shape: ActivationShape, device: torch.device, activations: bool) -> None:
        self.capacity = capacity
        self.tokens = torch.zeros(3 * token_stride(capacity), dtype=torch.int64, device=device)
        self.query = self.attention = self.hidden = None
        if activations:
            self.query = torch.zeros(capacity, shape.num_heads, shape.head_dim, dtype=shape.dtype, device=device)
            self.attention = torch.zeros(capacity, shape.num_heads * shape.head_dim, dtype=shape.dtype, device=device)
            self.hidden = torch.zeros(capacity, shape.hidden_size, dtype=shape.dtype, device=device)

    @staticmethod
    def num_bytes(capacity: int, shape: ActivationShape, activations: bool) -> int:
        return 3 * token_stride(capacity) * 8 + (capacity * shape.bytes_per_row() if activations else 0)

    def fill_tokens(self, staging: PinnedStaging, inputs: StepInputs,
                    num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copy the step's token arrays, padded to num_rows rows (graph_shapes.stage_tokens), into
        the token buffer; returns its (input_ids, positions, slot_mapping) views of num_rows rows."""
        staged = stage_tokens(staging, inputs, num_rows)
        staging.copy(staged, self.tokens[:3 * token_stride(num_rows)])
        return token_views(self.tokens, num_rows)
