"""CUDA-graph helpers of the GPU tests."""

from collections.abc import Callable

import torch


def capture_and_replay(step: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Run step() once on a side stream (Triton compiles, libraries pick their kernels), capture it
    in a CUDA graph, zero the captured output and replay the graph: the replay's output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return out
