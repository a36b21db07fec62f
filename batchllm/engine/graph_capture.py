"""Capturing a runner's CUDA graphs: one memory pool and one stream for all of them."""

from __future__ import annotations

from collections.abc import Callable

import torch


class GraphCaptureError(RuntimeError):
    """A CUDA graph could not be captured: the engine refuses to run rather than fall back to eager
    steps unnoticed."""


class GraphCapture:
    """Every graph of a runner is captured on one stream into one memory pool. A graph's outputs
    are copied into the runner's static buffers (engine/step_buffers.py) inside the graph, so no
    tensor of the pool outlives its capture: the pool then holds only temporaries, which graphs
    that never run at the same time (one stream) may share, and its size is that of the largest
    graph's temporaries, not their sum."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)
        self.num_captured = 0

    def capture(self, run: Callable[[], None], what: str) -> torch.cuda.CUDAGraph:
        """run() once on the capture stream (a warm-up: Triton compiles, cuBLAS picks its kernels and
        workspace for this stream), then captured. `what` names the graph in the error.

        torch.cuda.graph's context would also synchronize the device and empty the caching
        allocators (and in some versions collect garbage) before each capture, hundreds of times
        at start-up; the capture calls below are the rest of what it does."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(self.stream):
                run()
                graph.capture_begin(pool=self.pool)
                try:
                    run()
                finally:
                    graph.capture_end()
        except Exception as error:
            raise GraphCaptureError(f"capturing the CUDA graph of {what} failed ({error!r}); run with "
                                    "--enforce-eager (LLM(enforce_eager=True)) to run every step eagerly") from error
        current.wait_stream(self.stream)
        self.num_captured += 1
        return graph
