"""CUDA-graph helpers of the GPU tests."""

from collections.abc import Callable

import torch


def capture(step: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Run step() once on a side stream (Triton compiles, libraries pick their kernels and allocate
    their workspaces), then capture it in a CUDA graph: the graph and its output tensor."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def capture_and_replay(step: Callable[[], torch.Tensor]) -> torch.Tensor:
    """capture(step), zero the captured output and replay the graph: the replay's output."""
    graph, out = capture(step)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return out
