"""Microseconds per call of small GPU kernels, timed as a frame runs them: many calls in one CUDA graph."""

from __future__ import annotations

from typing import Callable

import torch


def us_per_call(call: Callable[[int], object], calls: int, replays: int = 50) -> float:
    """call(i) for i in range(calls), captured in one graph (after 3 warm-up passes), replayed `replays` times;
    the mean microseconds per call, launch gaps inside the graph included."""
    for _ in range(3):
        for i in range(calls):
            call(i)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays / calls


def captured_on(stream: torch.cuda.Stream, call: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """call() run once on `stream` (lazy initialisation), then captured on it: the graph's kernels keep that
    stream's priority whatever stream replays them (PyTorch instantiates graphs with
    cudaGraphInstantiateFlagUseNodePriority)."""
    with torch.cuda.stream(stream):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        call()
    torch.cuda.synchronize()
    return graph
