"""Placeholder input ids of asynchronous scheduling.

With asynchronous scheduling the engine schedules step N+1 before step N's sampled tokens
reach the host. The scheduler then holds a placeholder -(i + 1) for each token not yet known,
where i is the token's row in step N's sampled output; the model runner swaps the placeholders
for the real ids on the device, so nothing waits for the host. The scheduler learns the real
ids at its next update() (its resolved_token_ids argument).
"""

from __future__ import annotations

import numpy as np
import torch


def placeholder_for_row(row: int) -> int:
    """The placeholder id of the token sampled at row `row` of the previous step."""
    return -(row + 1)


def has_placeholders(input_ids: np.ndarray) -> bool:
    return bool(input_ids.size) and int(input_ids.min()) < 0


def placeholder_source(input_ids: np.ndarray, previous_token_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor to resolve a step's placeholders from, or None when it has none. Raises when
    the step holds placeholders but the previous step's tokens were not given."""
    if not has_placeholders(input_ids):
        return None
    if previous_token_ids is None:
        raise ValueError("the step holds placeholder input ids but the previous step's tokens were not given")
    return previous_token_ids


def resolve_placeholders_(input_ids: torch.Tensor, previous_token_ids: torch.Tensor | None) -> None:
    """In place, on the device: input id -(i + 1) -> previous_token_ids[i] (no host sync)."""
    if previous_token_ids is None:
        raise ValueError("the step holds placeholder input ids but the previous step's tokens were not given")
    last = max(previous_token_ids.shape[0] - 1, 0)
    index = (-input_ids - 1).clamp_(min=0, max=last)
    input_ids.copy_(torch.where(input_ids < 0, previous_token_ids.to(input_ids.dtype)[index], input_ids))
