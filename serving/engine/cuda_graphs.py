"""Whole-frame CUDA graphs of the talker stage: one graph per (batch bucket, KV-length bucket).

A frame is ~100 transformer layer passes (28 talker + 15 x 5 code predictor) plus 16 draws: thousands of small
kernels whose launch gaps, not the GPU, set the pace at small batch. Replaying one captured graph per frame
removes the gaps. The captured step reads and writes only the stage's preallocated tensors (KV cache, slot
state, sampling parameters), so the graph needs no input copies; its shapes are fixed by the batch bucket and
by a KV length bucket: attention runs over the first `kv` cache positions with a mask, so a graph serves every
step whose longest row fits, while short contexts do not pay for reading the whole slot.
Capture runs the step (a warm-up pass per graph), so it happens at start-up, on empty slots, never while
requests run; steps no graph covers (bigger batches, sampling options the graph's sampler does not take)
run eagerly.
"""

from __future__ import annotations

from typing import Callable

import torch

SMALLEST_KV_BUCKET = 128


def make_kv_buckets(max_model_len: int, smallest: int = SMALLEST_KV_BUCKET) -> tuple[int, ...]:
    """Powers of two from `smallest`, then max_model_len itself: at most 2x the keys read, few graphs."""
    if max_model_len < 1:
        raise ValueError("max_model_len must be at least 1")
    sizes, size = [], smallest
    while size < max_model_len:
        sizes.append(size)
        size *= 2
    sizes.append(max_model_len)
    return tuple(sizes)


GRAPH_BATCHES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def make_graph_buckets(num_slots: int, max_graph_batch: int) -> tuple[int, ...]:
    """Batch sizes that get graphs: a coarse ladder up to min(num_slots, max_graph_batch), which is always
    one. A step over fewer rows replays the next larger graph; the extra rows are empty slots (inactive,
    their outputs unread), which costs little since a frame's time is mostly weight reads shared by all rows."""
    top = min(num_slots, max_graph_batch)
    return tuple(sorted({b for b in GRAPH_BATCHES if b < top} | {top}))


def smallest_cover(value: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= value, or None when none is that large."""
    for b in buckets:
        if b >= value:
            return b
    return None


Step = Callable[[int, int], tuple[torch.Tensor, ...]]


class FrameGraphs:
    """Captured frames keyed by (batch, kv_len); `step(batch, kv_len)` returns the frame's output tensors."""

    def __init__(self, step: Step, device: torch.device):
        self.step = step
        self.device = device
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self.pool = None
        self.memory_bytes = 0  # device memory the graphs' private pool took

    def capture(self, batch: int, kv_len: int) -> None:
        """Run the step once on a side stream (lazy initialisation, compilation), then capture it."""
        before = torch.cuda.memory_reserved(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.step(batch, kv_len)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.step(batch, kv_len)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[(batch, kv_len)] = (graph, out)
        torch.cuda.synchronize(self.device)
        self.memory_bytes += max(0, torch.cuda.memory_reserved(self.device) - before)

    def covers(self, batch: int, kv_len: int) -> bool:
        return (batch, kv_len) in self.graphs

    def replay(self, batch: int, kv_len: int) -> tuple[torch.Tensor, ...]:
        graph, out = self.graphs[(batch, kv_len)]
        graph.replay()
        return out
