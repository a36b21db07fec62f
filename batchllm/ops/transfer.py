"""Host-to-device copies through pinned memory, without blocking: a copy from pageable memory would
wait for every step queued on the stream, which defeats asynchronous scheduling.

The engine's steps go through one `PinnedStaging`: persistent pinned buffers, filled in place and
reused step after step (a fresh pinned buffer costs an allocation and a host-allocator event per
copy). `to_device` and `upload_arrays` are the one-off forms for tests and tools."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch

# How a runner's step hands arrays to the device: name -> array in, name -> device view out.
Upload = Callable[[dict[str, np.ndarray]], dict[str, torch.Tensor]]

ALIGN_BYTES = 16  # every staged array starts 16-byte aligned: Triton specialises pointers on it


def to_device(tensor: torch.Tensor | np.ndarray, device: torch.device) -> torch.Tensor:
    if isinstance(tensor, np.ndarray):
        tensor = torch.from_numpy(np.ascontiguousarray(tensor))
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of a numpy dtype (int32, int64, float32, float64, bool, uint8, ...)."""
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN_BYTES) * ALIGN_BYTES


def _packed_offsets(arrays: dict[str, np.ndarray]) -> list[int]:
    return [0, *accumulate(_aligned(array.nbytes) for array in arrays.values())]


def _pack_into(flat: np.ndarray, arrays: dict[str, np.ndarray], offsets: list[int]) -> None:
    for array, offset in zip(arrays.values(), offsets):
        flat[offset:offset + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _views(buffer: torch.Tensor, arrays: dict[str, np.ndarray], offsets: list[int]) -> dict[str, torch.Tensor]:
    return {name: buffer[offset:offset + array.nbytes].view(torch_dtype(array.dtype)).view(array.shape)
            for (name, array), offset in zip(arrays.items(), offsets)}


def upload_arrays(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Arrays on the device, in one fresh pinned buffer and one copy (one-off uploads: tests,
    tools; the engine's steps use PinnedStaging)."""
    if device.type != "cuda":
        return {name: to_device(array, device) for name, array in arrays.items()}
    offsets = _packed_offsets(arrays)
    flat = np.empty(offsets[-1], dtype=np.uint8)
    _pack_into(flat, arrays, offsets)
    return _views(to_device(flat, device), arrays, offsets)


@dataclass(frozen=True)
class Staged:
    """A region of the current turn's host buffer: `array` (a numpy view) to fill in place, then
    PinnedStaging.copy sends it to the device."""

    array: np.ndarray
    source: torch.Tensor  # the same bytes as a uint8 host tensor


class PinnedStaging:
    """The one way a runner's host arrays reach the device: two persistent host buffers (pinned on
    CUDA) used in turn, one per step, and one persistent device buffer for the step's variable
    arrays (`upload`); fixed device tensors (a CUDA graph's static inputs) are filled with
    `stage` + `copy`.

    Turns: with asynchronous scheduling the host fills step N+1 while step N's copies may still be
    queued behind step N-1 on the stream, so step N+1 writes the other buffer. Each turn ends with
    an event recorded after its copies; waiting on it before the turn's buffer is filled again is
    a safety net that never blocks with one step in flight (step N-1 has been read before step
    N+1 is launched). Device memory needs no second copy: the stream orders step N+1's copies
    after step N's kernels.

    On the CPU the same code runs with plain host memory and synchronous copies."""

    def __init__(self, device: torch.device, num_bytes: int = 1 << 20) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._host = [self._host_buffer(num_bytes) for _ in range(2)]
        self._host_arrays = [host.numpy() for host in self._host]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._retired: list[tuple[torch.Tensor, torch.cuda.Event]] = []  # grown-out-of buffers still copying
        self._turn = 0
        self._host_used = 0
        self._device = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        self._device_used = 0
        self.num_host_allocations = 2  # pinned buffers allocated so far (grows only with a larger step)

    @property
    def pinned(self) -> bool:
        """Whether the host buffers are pinned (on CUDA: copies from them do not block)."""
        return all(host.is_pinned() for host in self._host)

    def _host_buffer(self, num_bytes: int) -> torch.Tensor:
        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=self._cuda)

    def begin_step(self) -> None:
        """Start a step: the other host buffer, once its previous copies are done; the device
        buffer from its start."""
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
            self._copied[self._turn] = event
            self._retired = [(host, done) for host, done in self._retired if not done.query()]
        self._turn = 1 - self._turn
        copied = self._copied[self._turn]
        if copied is not None and not copied.query():
            copied.synchronize()
        self._host_used = 0
        self._device_used = 0

    def stage(self, shape: int | tuple[int, ...], dtype: np.dtype | type) -> Staged:
        """A fresh region of this step's host buffer shaped `shape`, holding whatever an earlier step
        left there: the caller writes every element the device will read."""
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        num_bytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        start = self._host_used
        if start + num_bytes > self._host[self._turn].shape[0]:
            self._grow_host(num_bytes)
            start = 0
        self._host_used = start + _aligned(num_bytes)
        source = self._host[self._turn][start:start + num_bytes]
        array = self._host_arrays[self._turn][start:start + num_bytes].view(dtype).reshape(shape)
        return Staged(array, source)

    def _grow_host(self, num_bytes: int) -> None:
        """A larger buffer for this turn; the old one lives until the copies queued from it are done."""
        old = self._host[self._turn]
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
            self._retired.append((old, event))
        size = max(2 * old.shape[0], _aligned(self._host_used + num_bytes))  # this step's whole use fits next time
        self._host[self._turn] = self._host_buffer(size)
        self._host_arrays[self._turn] = self._host[self._turn].numpy()
        self.num_host_allocations += 1

    def copy(self, staged: Staged, destination: torch.Tensor) -> None:
        """destination (a contiguous tensor of the staged bytes) <- staged, without blocking."""
        target = destination.view(-1).view(torch.uint8)
        if target.shape != staged.source.shape or not destination.is_contiguous():
            raise ValueError(f"a staged copy needs a contiguous destination of {staged.source.shape[0]} bytes, "
                             f"got {tuple(destination.shape)} {destination.dtype}")
        target.copy_(staged.source, non_blocking=self._cuda)

    def upload(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """The arrays on the device, valid for this step: packed into one staged region and sent by
        one copy into the step's part of the device buffer (an Upload)."""
        offsets = _packed_offsets(arrays)
        staged = self.stage(offsets[-1], np.uint8)
        _pack_into(staged.array, arrays, offsets)
        start = self._device_used
        if start + offsets[-1] > self._device.shape[0]:
            # The arrays uploaded earlier this step keep the old buffer alive through their views.
            self._device = torch.empty(max(2 * self._device.shape[0], offsets[-1]), dtype=torch.uint8,
                                       device=self.device)
            start = 0
        self._device_used = start + offsets[-1]
        region = self._device[start:start + offsets[-1]]
        self.copy(staged, region)
        return _views(region, arrays, offsets)
