"""Placeholder input ids of asynchronous scheduling: -(i + 1) stands for the token sampled at row i
of the previous step, resolved on the device (docs/design.md, "The step loop")."""

from __future__ import annotations

import numpy as np
import torch


def placeholder_for_row(row: int) -> int:
    """The placeholder id of the token sampled at row `row` of the previous step."""
    return -(row + 1)


def placeholder_source(input_ids: np.ndarray, previous_token_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor to resolve a step's placeholders from; None when the step has none."""
    if not input_ids.size or int(input_ids.min()) >= 0:
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
