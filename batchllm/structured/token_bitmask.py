"""A step's token bitmask: one row of allowed-token bits per constrained sampled row, filled by
xgrammar's threads and sent to the device in one copy."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch
import xgrammar

from batchllm.ops.transfer import PinnedStaging
from batchllm.structured.grammar_state import GrammarState


class TokenBitmaskFiller:
    def __init__(self, max_threads: int | None = None) -> None:
        """max_threads: xgrammar's fill threads (default: half the CPUs, at most 8)."""
        self.num_threads = max_threads if max_threads is not None else max(1, min(8, (os.cpu_count() or 2) // 2))
        self._batch = xgrammar.BatchGrammarMatcher(self.num_threads)

    def fill(self, states: Sequence[GrammarState], rows: Sequence[int], vocab_size: int,
             staging: PinnedStaging) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [n] int64, bitmask [n, ceil(vocab_size / 32)] int32) on the staging's device: bit j
        of word w of row i allows token 32 w + j at step row rows[i]. Filled in place in the step's
        staged host memory and sent in one copy. Every state's matcher must be ready."""
        num_rows, num_words = len(states), -(-vocab_size // 32)
        num_mask_words = num_rows * num_words
        staged = staging.stage(num_mask_words + num_rows, np.int32)
        host = torch.from_numpy(staged.array)
        self._batch.batch_fill_next_token_bitmask([state.matcher for state in states],
                                                  host[:num_mask_words].view(num_rows, num_words))
        staged.array[num_mask_words:] = rows
        on_device = torch.empty(num_mask_words + num_rows, dtype=torch.int32, device=staging.device)
        staging.copy(staged, on_device)
        return on_device[num_mask_words:].to(torch.int64), on_device[:num_mask_words].view(num_rows, num_words)
