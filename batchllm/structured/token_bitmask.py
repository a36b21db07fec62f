"""A step's token bitmask: one row of allowed-token bits per constrained sampled row, filled by
xgrammar's threads and sent to the device in one copy."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import xgrammar

from batchllm.structured.grammar_state import GrammarState


class TokenBitmaskFiller:
    def __init__(self, max_threads: int | None = None) -> None:
        """max_threads: xgrammar's fill threads (default: half the CPUs, at most 8)."""
        self.num_threads = max_threads if max_threads is not None else max(1, min(8, (os.cpu_count() or 2) // 2))
        self._batch = xgrammar.BatchGrammarMatcher(self.num_threads)

    def fill(self, states: Sequence[GrammarState], rows: Sequence[int], vocab_size: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [n] int64, bitmask [n, ceil(vocab_size / 32)] int32) on the device: bit j of word w
        of row i allows token 32 w + j at step row rows[i]. Every state's matcher must be ready."""
        num_rows, num_words = len(states), -(-vocab_size // 32)
        host = torch.empty(num_rows * (num_words + 1), dtype=torch.int32, pin_memory=device.type == "cuda")
        bitmask = host[:num_rows * num_words].view(num_rows, num_words)
        self._batch.batch_fill_next_token_bitmask([state.matcher for state in states], bitmask)
        host[num_rows * num_words:] = torch.tensor(rows, dtype=torch.int32)
        on_device = host.to(device, non_blocking=True) if device.type == "cuda" else host
        return on_device[num_rows * num_words:].to(torch.int64), on_device[:num_rows * num_words].view(num_rows, num_words)
