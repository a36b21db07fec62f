"""What a runner's step gives the step loop: the sampled rows, on the device and on their way to
the host."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchllm.engine.sampler import SamplerOutput


@dataclass(frozen=True)
class StepResult:
    seq_ids: tuple[int, ...]  # one per sampled row
    sampled: SamplerOutput | None  # None when nothing was sampled this step (device tensors)
    # CUDA: pinned host copies of `sampled`, filled by a non-blocking copy queued right after
    # the sampler, and the event that marks them ready. Waiting on the event waits for this
    # step only; `.tolist()` on the device tensors would also wait for every step queued after
    # it (asynchronous scheduling queues the next step before reading this one).
    host_sampled: SamplerOutput | None = None
    host_ready: torch.cuda.Event | None = None

    def host_output(self) -> SamplerOutput | None:
        """The sampled output on the host (waits for this step's copy)."""
        if self.host_ready is None:
            return self.sampled
        self.host_ready.synchronize()
        return self.host_sampled
