"""CUDA graphs of the codec's incremental decode step, one per (batch bucket, frames bucket).

A codec call is hundreds of small kernels: on an H100 a 4-frame call takes 22 ms, mostly launch gaps, while
16 rows of 25 frames take 56 ms (docs/performance.md). Replaying a captured step removes the gaps. The captured
function reads only static buffers (the rows' codes, slots, new-frame counts and first flags) and the
incremental decoder's state pool, and writes the pool and one output buffer, so a replay needs only two
host-to-device copies before it. A call replays the cheapest bucket that covers its rows and frames: extra
rows use the pool's scratch slot with 0 new frames and a fresh start (their state stays zero, their samples
are unread), extra frames are right padding (the decoder is causal and each row's state is gathered at its
own chunk end, so padding changes none of a row's samples or state). Calls beyond every bucket run eagerly
with their exact shapes.

The frames buckets are the chunk sizes streaming produces: the first chunk (--first-chunk-frames), its
doublings, the steady chunk (--chunk-frames), and powers of two below it for short final chunks and request-level first chunks
(initial_codec_chunk_frames, at most --chunk-frames), each padded up to the next bucket.

Memory: all graphs share one pool, so the intermediates of one step are reused by the next graph's capture;
each graph keeps its own output. Under a budget, buckets are captured cheapest first, each only if the memory
taken so far plus its estimate (the peak of its eager step) fits, so the largest buckets are the ones dropped.
On a CPU (tests) a bucket is only registered and its "replay" runs the same function eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from serving.engine.cuda_graphs import FrameGraphs, ladder
from serving.model.codec_stream import IncrementalCodecDecoder, chunk_plan

log = logging.getLogger("serving.engine")

Bucket = tuple[int, int]  # (batch, frames)


def make_frame_buckets(first_chunk_frames: int, chunk_frames: int) -> tuple[int, ...]:
    """The chunk sizes of the streaming schedule (first chunk, doubling, steady chunk: codec_stream.chunk_plan),
    and powers of two below the steady chunk (final chunks and request first chunks pad up to the next one: at
    most 2x the frames, usually far less)."""
    if min(first_chunk_frames, chunk_frames) < 1:
        raise ValueError("chunk sizes must be at least 1 frame")
    sizes = set(chunk_plan(first_chunk_frames + 4 * chunk_frames, first_chunk_frames, chunk_frames)[:-1])  # not the remainder
    size = 1
    while size < chunk_frames:
        sizes.add(size)
        size *= 2
    return tuple(sorted(sizes))


def make_batch_buckets(max_codec_batch: int, batches: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The codec batch sizes that get graphs: `batches` as given (each in [1, max_codec_batch]; empty: no
    graphs), or by default powers of two and 1.5 times each (1, 2, 3, 4, 6, 8, 12, ...) below max_codec_batch,
    and max_codec_batch itself. A call pads its rows up to the next size: with powers of two alone ~14-18% of the
    frames served calls computed were such padding rows, with this ladder 6-8%, for ~3% more audio per second
    (H100, docs/performance.md, seventeenth pass)."""
    if batches is None:
        batches = ladder(max_codec_batch, 1)
    if any(not 1 <= b <= max_codec_batch for b in batches):
        raise ValueError(f"codec graph batch sizes must lie in [1, {max_codec_batch}] (the most chunks one codec "
                         f"call decodes), got {list(batches)}")
    return tuple(sorted(set(batches)))


def parse_batches(text: str | None) -> tuple[int, ...] | None:
    """'1,2,4,8' -> (1, 2, 4, 8); None or '' -> None (the default ladder); 'none' -> () (no codec graphs)."""
    if text is None or not text.strip():
        return None
    if text.strip().lower() == "none":
        return ()
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--codec-graph-batches must be comma-separated integers or 'none', got {text!r}") from None


def cover(buckets, batch: int, frames: int) -> Bucket | None:
    """The cheapest bucket (fewest batch x frames, then fewest rows) with at least `batch` rows and `frames`
    frames, or None."""
    fits = [b for b in buckets if b[0] >= batch and b[1] >= frames]
    return min(fits, key=lambda b: (b[0] * b[1], b[0])) if fits else None


def keep_within_budget(order: list[Bucket], estimate: Callable[[Bucket], int], capture: Callable[[Bucket], int],
                       budget_bytes: int | None) -> tuple[list[Bucket], list[Bucket]]:
    """Capture buckets in `order` (cheapest first) while the memory taken so far plus the next one's estimate fits
    the budget (None: no limit). capture(bucket) returns what it took. Returns (kept, dropped)."""
    used, kept = 0, []
    for i, bucket in enumerate(order):
        if budget_bytes is not None and used + estimate(bucket) > budget_bytes:
            return kept, order[i:]
        used += capture(bucket)
        kept.append(bucket)
    return kept, []


def pad_rows(rows: list[tuple[int, np.ndarray, bool]], batch: int, frames: int, scratch_slot: int,
             num_quantizers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[(slot, codes (n, Q), first), ...] -> host tensors (codes (batch, frames, Q), meta (3, batch): slots,
    new frames, first), rows right-padded to `frames` and the batch padded with scratch rows of 0 frames."""
    codes = np.zeros((batch, frames, num_quantizers), dtype=np.int64)
    meta = np.zeros((3, batch), dtype=np.int64)
    meta[0], meta[2] = scratch_slot, 1
    for i, (slot, row, first) in enumerate(rows):
        codes[i, : len(row)] = row
        meta[:, i] = slot, len(row), first
    return torch.from_numpy(codes), torch.from_numpy(meta)


def run_step(pool: IncrementalCodecDecoder, codes_btq: torch.Tensor, meta_3b: torch.Tensor) -> torch.Tensor:
    """One decode step from a batch's codes and meta (slots, new frames, first): the function graphs capture."""
    return pool.step(codes_btq, meta_3b[0], meta_3b[1], meta_3b[2].bool())


@dataclass(frozen=True)
class CodecGraphReport:
    """What was captured: each graph's (batch, frames, bytes), the total, the budget and the buckets it dropped."""

    graphs: tuple[tuple[int, int, int], ...]
    dropped: tuple[Bucket, ...]
    total_bytes: int
    budget_bytes: int | None

    def describe(self) -> dict:
        return {"codec_graphs": [{"batch": b, "frames": f, "memory_bytes": m} for b, f, m in self.graphs],
                "codec_graph_memory_bytes": self.total_bytes, "codec_graph_budget_bytes": self.budget_bytes,
                "codec_graphs_dropped": [list(b) for b in self.dropped]}


class CodecGraphs:
    """Static buffers and captured steps per bucket; `run(rows)` decodes through the cheapest covering bucket."""

    def __init__(self, pool: IncrementalCodecDecoder, buckets: list[Bucket], num_quantizers: int,
                 device: torch.device):
        self.pool = pool
        self.buckets = sorted(set(buckets), key=lambda b: (b[0] * b[1], b[0]))
        self.num_quantizers = num_quantizers
        self.device = device
        self.static: dict[Bucket, tuple[torch.Tensor, torch.Tensor]] = {}
        self.frame_graphs = FrameGraphs(self._captured, device) if device.type == "cuda" else None
        self.memory: dict[Bucket, int] = {}  # bucket -> bytes: graph pool growth at capture + static inputs
        self.report = CodecGraphReport((), (), 0, None)

    def _captured(self, batch: int, frames: int) -> tuple[torch.Tensor]:
        codes, meta = self.static[(batch, frames)]
        return (run_step(self.pool, codes, meta),)

    def _buffers(self, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        """Static inputs at rest: every row a scratch row (what capture and warm-up decode)."""
        codes, meta = pad_rows([], *bucket, self.pool.scratch_slot, self.num_quantizers)
        return codes.to(self.device), meta.to(self.device)

    @torch.inference_mode()
    def capture_all(self, budget_bytes: int | None) -> CodecGraphReport:
        """Estimate every bucket by an eager step, capture the cheapest first within the budget, log the result."""
        estimates = {b: self._estimate(b) for b in self.buckets}
        order = sorted(self.buckets, key=lambda b: (estimates[b], b[0] * b[1]))
        kept, dropped = keep_within_budget(order, estimates.__getitem__, self._capture, budget_bytes)
        for bucket in dropped:
            del self.static[bucket]
        self.report = CodecGraphReport(tuple((b, f, self.memory[(b, f)]) for b, f in sorted(kept)),
                                       tuple(sorted(dropped)), sum(self.memory.values()), budget_bytes)
        mib = 2**-20
        log.info("codec graphs: %d captured, %.0f MiB in all%s: %s", len(kept), self.report.total_bytes * mib,
                 "" if budget_bytes is None else f" (budget {budget_bytes * mib:.0f} MiB)",
                 ", ".join(f"{b}x{f} {m * mib:.1f} MiB" for b, f, m in self.report.graphs) or "none")
        if dropped:
            log.warning("codec graphs: dropped %d bucket(s) (batch x frames) over the --codec-graph-memory-gb budget, "
                        "they run eagerly: %s", len(dropped), ", ".join(f"{b}x{f}" for b, f in sorted(dropped)))
        return self.report

    def _estimate(self, bucket: Bucket) -> int:
        """Bytes an eager step of the bucket allocates at its peak, beyond what was allocated before (0 on CPU)."""
        self.static[bucket] = self._buffers(bucket)
        if self.device.type != "cuda":
            self._captured(*bucket)
            return 0
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._captured(*bucket)
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - base

    def _capture(self, bucket: Bucket) -> int:
        codes, meta = self.static[bucket]
        inputs = codes.numel() * codes.element_size() + meta.numel() * meta.element_size()
        graph_bytes = 0
        if self.frame_graphs is not None:
            before = self.frame_graphs.memory_bytes
            self.frame_graphs.capture(*bucket)
            graph_bytes = self.frame_graphs.memory_bytes - before
        self.memory[bucket] = graph_bytes + inputs
        return self.memory[bucket]

    def covering(self, batch: int, frames: int) -> Bucket | None:
        return cover(self.memory, batch, frames)

    @torch.inference_mode()
    def replay(self, bucket: Bucket, codes_btq: torch.Tensor, meta_3b: torch.Tensor) -> torch.Tensor:
        """Copy a padded batch (host tensors of the bucket's shapes) into the bucket's static inputs and run its
        graph (on a CPU, the captured function eagerly). The output is the graph's: read it before the next call.
        On CUDA the inputs go through pinned memory without waiting: a copy from pageable memory waits for the
        stream, which held the codec thread in a blocking CUDA wait until the work queued before was done (py-spy,
        docs/performance.md, twenty-fourth pass), and blocking waits slow the talker's launches."""
        codes, meta = self.static[bucket]
        if self.frame_graphs is not None:
            codes.copy_(codes_btq.pin_memory(), non_blocking=True)
            meta.copy_(meta_3b.pin_memory(), non_blocking=True)
            return self.frame_graphs.replay(*bucket)[0]
        codes.copy_(codes_btq)
        meta.copy_(meta_3b)
        return self._captured(*bucket)[0]


class PrimeGraphs:
    """A voice's priming (IncrementalCodecDecoder.prime_padded) captured per padded (rows, frames) shape.

    Priming is an eager pass over a reference's codes: on an H100 the first codec call of a stream of a new voice
    took 28-37 ms where a cached voice's took 5-7 (fifteenth pass), for ~1 ms of GPU work, the rest launches.
    Its calls are padded to a few shapes (PRIME_ROWS rows, multiples of PRIME_FRAMES frames), so each gets a graph
    that reads only static buffers (codes, slots, lengths) and writes the state pool. The graphs share the decode
    graphs' pool (one thread replays both, one after another), so they add little memory. Shapes not captured
    (references longer than warm-up met) are not run here: `run` returns False and the caller primes eagerly.
    On a CPU (tests) a shape is only registered and its "replay" runs the same function eagerly."""

    def __init__(self, pool: IncrementalCodecDecoder, shapes: list[Bucket], num_quantizers: int,
                 device: torch.device):
        self.pool = pool
        self.device = device
        self.static = {(rows, frames): (torch.zeros((rows, frames, num_quantizers), dtype=torch.long, device=device),
                                        torch.full((rows,), pool.scratch_slot, dtype=torch.long, device=device),
                                        torch.zeros(rows, dtype=torch.long, device=device))
                       for rows, frames in shapes}
        self.frame_graphs = FrameGraphs(self._captured, device) if device.type == "cuda" else None

    def _captured(self, rows: int, frames: int) -> tuple:
        self.pool.prime_padded(*self.static[(rows, frames)])
        return ()

    @torch.inference_mode()
    def capture_all(self, memory_pool=None) -> None:
        """Capture every shape (at rest its static rows are the scratch slot's, of no frames: capture writes
        zeros there, as the scratch slot only ever receives); memory_pool: the decode graphs' pool to share."""
        if self.frame_graphs is None:
            return
        self.frame_graphs.pool = memory_pool
        for shape in self.static:
            self.frame_graphs.capture(*shape)
        log.info("codec priming graphs: %d captured, %.0f MiB: %s", len(self.static),
                 self.frame_graphs.memory_bytes / 2**20, ", ".join(f"{r}x{f}" for r, f in self.static))

    @torch.inference_mode()
    def run(self, codes: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor) -> bool:
        """Prime a padded batch (IncrementalCodecDecoder.prime_batch) through its shape's graph; False, and
        nothing done, where no graph holds its shape."""
        static = self.static.get((len(slots), codes.shape[1]))
        if static is None:
            return False
        for buffer, value in zip(static, (codes, slots, lengths), strict=True):
            buffer.copy_(value)
        if self.frame_graphs is not None:
            self.frame_graphs.replay(len(slots), codes.shape[1])
        else:
            self._captured(len(slots), codes.shape[1])
        return True

    def describe(self) -> dict:
        return {"codec_prime_graphs": [list(shape) for shape in self.static],
                "codec_prime_graph_memory_bytes": self.frame_graphs.memory_bytes if self.frame_graphs else 0}
