"""Prompt logprobs (vLLM's `prompt_logprobs`): the log-softmax of the logits at a step's prompt rows
of the requests that ask for them, and their top tokens. The LM head runs on those rows only, in an
eager call after the forward (graphed or not), so a step without them pays nothing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

# Rows per LM-head call: bounds the [rows, vocab] float32 logits (256 x 152k x 4 B = 156 MB).
ROWS_PER_CALL = 256


@dataclass(frozen=True)
class PromptLogprobRows:
    """What a step asks the runner for: the token rows (the step's flat row order) whose logits
    score the next prompt token, that token, and how many top tokens to return (the most any of
    the rows' requests asks for)."""

    rows: np.ndarray  # [num_rows] int64
    target_ids: np.ndarray  # [num_rows] int64: the prompt token at the row's position + 1
    num_top: int


@dataclass(frozen=True)
class PromptLogprobs:
    """Per PromptLogprobRows row: the logprob of its target token and the top num_top (tensors on
    the device, or on the host once `ready` has fired)."""

    target_logprobs: torch.Tensor  # [num_rows] float32
    target_ranks: torch.Tensor  # [num_rows] int64: 1 + the number of tokens more likely than the target
    top_logprobs: torch.Tensor  # [num_rows, num_top] float32
    top_token_ids: torch.Tensor  # [num_rows, num_top] int64
    ready: torch.cuda.Event | None = None  # set when the tensors are pinned host copies in flight

    def host_lists(self) -> tuple[list[float], list[int], list[list[float]], list[list[int]]]:
        """The values as Python lists (waits for this step's copy only)."""
        if self.ready is not None:
            self.ready.synchronize()
        return (self.target_logprobs.tolist(), self.target_ranks.tolist(), self.top_logprobs.tolist(),
                self.top_token_ids.tolist())


def compute_prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                            rows: torch.Tensor, target_ids: torch.Tensor, num_top: int) -> PromptLogprobs:
    """compute_logits: the model's LM head (hidden [N, H] -> float32 logits [N, V]). rows and
    target_ids on hidden's device. On CUDA the results are copied to pinned host memory without
    blocking: reading them waits for this step, not for the steps queued after it."""
    parts = ([], [], [], [])
    for start in range(0, rows.shape[0], ROWS_PER_CALL):
        logprobs = torch.log_softmax(compute_logits(hidden[rows[start:start + ROWS_PER_CALL]]), dim=-1)
        target = logprobs.gather(1, target_ids[start:start + ROWS_PER_CALL, None])
        top = torch.topk(logprobs, num_top, dim=-1)
        for part, tensor in zip(parts, (target.squeeze(1), (logprobs > target).sum(dim=-1) + 1, top.values,
                                        top.indices)):
            part.append(tensor)
    tensors = [torch.cat(part) for part in parts]
    if hidden.device.type != "cuda":
        return PromptLogprobs(*tensors)
    hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for host, tensor in zip(hosts, tensors):
        host.copy_(tensor, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return PromptLogprobs(*hosts, ready=ready)


def prompt_logprob_entry(num_top: int, target_id: int, target_logprob: float, top_values: list[float],
                         top_ids: list[int]) -> dict[int, float]:
    """One prompt position as vLLM returns it: {the prompt's token: its logprob, then the top
    num_top tokens by logprob} (num_top or num_top + 1 keys)."""
    entry = {target_id: target_logprob}
    entry.update(zip(top_ids[:num_top], top_values[:num_top]))
    return entry
