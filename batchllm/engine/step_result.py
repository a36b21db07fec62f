"""What a runner's step gives the step loop: the sampled rows, on the device and on their way to
the host."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from batchllm.engine.prompt_logprobs import PromptLogprobs
from batchllm.engine.sampler import SamplerOutput


@dataclass(frozen=True)
class HostCopy:
    """Pinned host copies of a step's SamplerOutput, the event that marks them ready, and the turn
    of SampledHostCopies they were written in (checked when they are read)."""

    sampled: SamplerOutput
    ready: torch.cuda.Event
    owner: "SampledHostCopies"
    turn: int
    generation: int


@dataclass(frozen=True)
class StepResult:
    seq_ids: Sequence[int]  # one per sampled row (StepInputs.sample_seq_ids)
    sampled: SamplerOutput | None  # None when nothing was sampled this step (device tensors)
    # CUDA: pinned host copies of `sampled`, filled by a non-blocking copy queued right after the
    # sampler. Waiting on its event waits for this step only; `.tolist()` on the device tensors
    # would also wait for every step queued after it (asynchronous scheduling queues the next
    # step before reading this one).
    host: HostCopy | None = None
    # the prompt rows' logprobs the step was asked for (PromptLogprobRows), in that order
    prompt_logprobs: PromptLogprobs | None = None

    def host_output(self) -> SamplerOutput | None:
        """The sampled output on the host (waits for this step's copy). Read it before the runner
        launches the step after next: its pinned buffer is then reused."""
        if self.host is None:
            return self.sampled
        self.host.owner.check_current(self.host)
        self.host.ready.synchronize()
        return self.host.sampled


class SampledHostCopies:
    """Persistent pinned buffers for the sampled outputs, one per turn in a ring of NUM_TURNS: a
    step's copy goes to the next turn's buffer, so a step's host copy stays valid until the step
    NUM_TURNS later (the step loop reads each step before it launches the step after next).
    A read of a buffer already reused raises instead of returning another step's tokens."""

    NUM_TURNS = 3

    def __init__(self, num_bytes: int = 1 << 16) -> None:
        self._buffers = [torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(self.NUM_TURNS)]
        self._generations = [0] * self.NUM_TURNS
        self._turn = 0

    def copy(self, sampled: SamplerOutput) -> HostCopy:
        """Queue non-blocking copies of every tensor of `sampled` into the next turn's buffer."""
        self._turn = (self._turn + 1) % self.NUM_TURNS
        turn = self._turn
        self._generations[turn] += 1
        tensors = (sampled.token_ids, sampled.logprobs, sampled.top_logprobs, sampled.top_token_ids)
        sizes = [0 if t is None else -(-t.numel() * t.element_size() // 16) * 16 for t in tensors]
        if sum(sizes) > self._buffers[turn].shape[0]:
            # (the caching host allocator keeps the old buffer until copies queued from it are done)
            self._buffers[turn] = torch.empty(2 * sum(sizes), dtype=torch.uint8, pin_memory=True)
        buffer, offset, hosts = self._buffers[turn], 0, []
        for tensor, size in zip(tensors, sizes):
            if tensor is None:
                hosts.append(None)
                continue
            host = buffer[offset:offset + tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)
            host.copy_(tensor, non_blocking=True)
            hosts.append(host)
            offset += size
        ready = torch.cuda.Event()
        ready.record()
        return HostCopy(SamplerOutput(*hosts), ready, self, turn, self._generations[turn])

    def check_current(self, copy: HostCopy) -> None:
        if self._generations[copy.turn] != copy.generation:
            raise RuntimeError("a step's sampled ids were read after their pinned buffer was reused: read every "
                               f"step before launching the step {self.NUM_TURNS} after it")
