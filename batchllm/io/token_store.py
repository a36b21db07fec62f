"""Many prompts' token ids in one flat int32 buffer (4 bytes per token, no Python int per token).

A Python list of ints costs ~36 bytes per token (8 for the pointer, 28 for the int object);
a 1M-request batch of 300-token prompts would need ~11 GB that way, ~1.2 GB here. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class TokenStore:
    """Append prompts; read them back as int32 array views (no copy)."""

    def __init__(self, initial_num_tokens: int = 1 << 16) -> None:
        self._tokens = np.empty(initial_num_tokens, dtype=np.int32)
        self._num_tokens = 0
        self._starts = np.zeros(1024, dtype=np.int64)  # start of prompt i; starts[n] = end
        self._num_prompts = 0

    def append(self, token_ids: Sequence[int] | np.ndarray) -> None:
        """Store one prompt. Ids must fit int32 (the parser checks)."""
        array = np.asarray(token_ids, dtype=np.int32)
        end = self._num_tokens + array.size
        if end > self._tokens.size:
            grown = np.empty(max(end, 2 * self._tokens.size), dtype=np.int32)
            grown[: self._num_tokens] = self._tokens[: self._num_tokens]
            self._tokens = grown
        self._tokens[self._num_tokens:end] = array
        if self._num_prompts + 2 > self._starts.size:
            self._starts = np.concatenate((self._starts, np.zeros(self._starts.size, dtype=np.int64)))
        self._num_tokens = end
        self._num_prompts += 1
        self._starts[self._num_prompts] = end

    def views(self) -> list[np.ndarray]:
        """Every prompt as an int32 view into the buffer (for the prefix planner)."""
        tokens = self._tokens[: self._num_tokens]
        starts = self._starts[: self._num_prompts + 1].tolist()
        return [tokens[a:b] for a, b in zip(starts[:-1], starts[1:])]
