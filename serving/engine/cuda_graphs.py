"""Whole-frame CUDA graphs of the talker stage: one graph per (batch bucket, KV-length bucket).

A frame is ~100 transformer layer passes (28 talker + 15 x 5 code predictor) plus 16 draws: thousands of small
kernels whose launch gaps, not the GPU, set the pace at small batch. Replaying one captured graph per frame
removes the gaps. The captured step reads and writes only the stage's preallocated tensors (KV cache, slot
state, sampling parameters), so the graph needs no input copies; its shapes are fixed by the batch bucket and
by a KV length bucket: attention runs over the first `kv` cache positions with a mask, so a graph serves every
step whose longest row fits, while short contexts do not pay for reading the whole slot. Steps whose attention
reads each row's own positions (the talker's fused and wide layers) are the same for every KV length: their
batch bucket gets one graph, keyed by KV length 0 (TalkerRunner.graph_kv_buckets).
Capture runs the step (a warm-up pass per graph), so it happens at start-up, on empty slots, never while
requests run; steps no graph covers (bigger batches, sampling options the graph's sampler does not take)
run eagerly.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch.nn.utils.rnn import pad_sequence

from serving.model.transfer import upload

SMALLEST_KV_BUCKET = 128


def wait_sleeping(event: torch.cuda.Event, stream: torch.cuda.Stream | None = None) -> None:
    """Until the work queued so far on `stream` (default: the current one) is done, polling with short sleeps.

    The talker and codec threads share one process: a blocking CUDA wait in one thread kept the other from
    launching its kernels (a codec call took up to 9x longer while the talker waited, docs/performance.md)."""
    event.record(stream)
    sleep_until(event)


def sleep_until(event: torch.cuda.Event) -> None:
    """Until a recorded event has happened, polling with short sleeps (see wait_sleeping)."""
    while not event.query():
        time.sleep(0.0002)


def ladder(limit: int, smallest: int) -> tuple[int, ...]:
    """Powers of two from `smallest` and 1.5 times each below `limit`, then `limit` itself: shapes to capture that
    cover any size up to `limit` with at most 1.5x the work of the size itself, two per doubling."""
    if limit < 1:
        raise ValueError("the largest size must be at least 1")
    sizes, size = [], smallest
    while size < limit:
        sizes += [b for b in (size, size * 3 // 2) if b < limit]
        size *= 2
    sizes.append(limit)
    return tuple(sorted(set(sizes)))


def make_kv_buckets(max_model_len: int, smallest: int = SMALLEST_KV_BUCKET) -> tuple[int, ...]:
    """The ladder of KV lengths: at most 1.5x the keys read (a step's attention reads every row's cache up to the
    bucket: on an H100, a 128-row step of the 0.6B talker spends ~3.7 us per position of it, so a bucket of 1024
    for rows of at most 700 costs ~0.9 ms more than one of 768), and two graphs per doubling of the length."""
    if max_model_len < 1:
        raise ValueError("max_model_len must be at least 1")
    return ladder(max_model_len, smallest)


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


def greatest_priority() -> int:
    """The most urgent CUDA stream priority (lower numbers go first)."""
    return torch.cuda.Stream.priority_range()[1]


class FrameGraphs:
    """Captured frames keyed by (batch, kv_len); `step(batch, kv_len)` returns the frame's output tensors.

    A replayed graph's kernels keep the priority of the stream they were captured on (PyTorch instantiates with
    cudaGraphInstantiateFlagUseNodePriority), whatever stream replays them: `priority` is that capture stream's.
    """

    def __init__(self, step: Step, device: torch.device, priority: int = 0):
        self.step = step
        self.device = device
        self.priority = priority
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self.pool = None
        self.memory_bytes = 0  # device memory the graphs' private pool took
        self._side: torch.cuda.Stream | None = None  # made at the first capture: CPU tests build FrameGraphs too

    def capture(self, batch: int, kv_len: int) -> None:
        """Run the step once on a side stream (lazy initialisation, compilation), then capture it on that stream.

        One side stream serves every capture: cuBLAS keeps a workspace (32 MiB on Hopper) per stream it meets, so
        a new stream per capture left ~34 MiB behind most of the codec's graphs (docs/performance.md)."""
        before = torch.cuda.memory_reserved(self.device)
        if self._side is None:
            self._side = torch.cuda.Stream(self.device, priority=self.priority)
        side = self._side
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.step(batch, kv_len)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=side):
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


PREFILL_GRAPH_ROWS = (1, 4, 16, 32, 64, 128)  # prompts per captured prefill (an admission pads up to the next)


def prefill_shapes(lengths: tuple[int, ...], max_rows: int, max_positions: int) -> tuple[tuple[int, int], ...]:
    """The (prompts, length) buckets that get prefill graphs: every length bucket for one prompt; for several, the
    PREFILL_GRAPH_ROWS below max_rows (the most an admission can hold) and max_rows itself, with the length buckets
    whose rows x length stay within max_positions (a batched pass's budget)."""
    rows = sorted({r for r in PREFILL_GRAPH_ROWS if r < max_rows} | {max_rows})
    return tuple((r, n) for r in rows for n in lengths if r == 1 or r * n <= max_positions)


class PrefillGraphs:
    """Prefills captured per (prompts, length) bucket, written straight into the requests' slots.

    An uncaptured prefill is ~28 x 20 kernel launches whose host cost dwarfs its GPU time (~40 ms on an H100 with
    compiled layers for one prompt, where its GPU time is ~1-3 ms; 20 ms of host for a batched pass of 31 long
    prompts, more under a busy server's HTTP handlers, docs/performance.md), and a server meets most (rows,
    length) shapes for the first time mid-burst. Prompts are right-padded to the bucket's length (causal
    attention: padding after a prompt changes none of its positions) and the batch to the bucket's rows by copies
    of the first prompt bound for its slot (the same inputs through the same kernels: their keys and values are
    its own, written where it writes them); the bucket's graph runs the talker over them into cache positions
    [0, length) of the slots its `rows` buffer names. The padding's keys land past each prompt, where no step
    reads them (see TalkerRunner._prefill_pass).
    `run` takes a device other than CUDA too, running the same function eagerly (tests), and returns None for
    prompts no bucket holds.
    """

    def __init__(self, stack, kv, shapes: tuple[tuple[int, int], ...], device: torch.device, dtype: torch.dtype,
                 priority: int = 0):
        self.stack = stack  # the talker's DecoderStack
        self.kv = kv  # the engine's KVCache: [layers, slots, heads, max_len, head_dim]
        self.shapes = tuple(sorted(shapes, key=lambda s: (s[0] * s[1], s[0])))  # cheapest first
        hidden = stack.cfg.hidden_size
        self._x = torch.zeros(max(r * n for r, n in shapes) * hidden, dtype=dtype, device=device)
        self.positions = torch.arange(max(n for _, n in shapes), device=device)[None]
        most = max(r for r, _ in shapes)
        self.rows = torch.zeros(most, 1, dtype=torch.int64, device=device)  # the slots of a run
        self.last = torch.zeros(most, dtype=torch.int64, device=device)  # each prompt's last position
        self.graphs = FrameGraphs(self._pass, device, priority) if device.type == "cuda" else None

    def _inputs(self, rows: int, length: int) -> torch.Tensor:
        """The bucket's input [rows, length, H]: a contiguous view of the one buffer every bucket shares."""
        return self._x[:rows * length * self.stack.cfg.hidden_size].view(rows, length, -1)

    def _pass(self, rows: int, length: int) -> tuple[torch.Tensor]:
        """The talker over the bucket's inputs -> the hidden state of each row's last position [rows, H] (a graph
        keeps only its output alive: [rows, H], not [rows, length, H])."""
        positions = self.positions[:, :length].expand(rows, length)
        out = self.stack(self._inputs(rows, length), positions, self.kv, positions, kv_len=length, mask=None,
                         rows=self.rows[:rows])
        return (out[torch.arange(rows, device=out.device), self.last[:rows]],)

    def capture_all(self) -> None:
        if self.graphs is not None:
            for rows, length in self.shapes:
                self.graphs.capture(rows, length)

    def bucket(self, count: int, longest: int) -> tuple[int, int] | None:
        """The cheapest (prompts, length) bucket that holds `count` prompts of up to `longest` positions."""
        return next(((r, n) for r, n in self.shapes if r >= count and n >= longest), None)

    def run(self, prompts: list[torch.Tensor], slots: list[int]) -> torch.Tensor | None:
        """prompts [L_i, H] bound for `slots` -> the post-norm hidden state of each one's last position [n, H] (a new
        tensor); their keys and values land in cache positions [0, L_i) of their slots (and the padding's up to
        the bucket's length); None when no bucket holds them."""
        lengths = [p.shape[0] for p in prompts]
        shape = self.bucket(len(prompts), max(lengths))
        if shape is None:
            return None
        rows, length = shape
        x, n, longest = self._inputs(rows, length), len(prompts), max(lengths)
        if n == 1:
            x[0, :longest] = prompts[0].to(x.dtype)
        else:
            x[:n, :longest] = pad_sequence([p.to(x.dtype) for p in prompts], batch_first=True)
        x[:n, longest:].zero_()  # a kernel; `= 0` would copy from the host after the step in flight
        x[n:] = x[0]
        pad = rows - n
        self.rows[:rows, 0] = upload(slots + [slots[0]] * pad, torch.int64, self.rows.device)
        self.last[:rows] = upload([m - 1 for m in lengths] + [lengths[0] - 1] * pad, torch.int64, self.last.device)
        out = self.graphs.replay(rows, length)[0] if self.graphs is not None else self._pass(rows, length)[0]
        return out[:n].clone()  # the graph's output buffer is the next replay's


class CacheView:
    """Keys and values with the attributes the model's layers read (as layers.KVCache)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v

    @property
    def max_len(self) -> int:
        return self.k.shape[3]
