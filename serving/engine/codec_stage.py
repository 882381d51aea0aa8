"""Stage 1: codes -> audio, chunk by chunk, batched across requests, each frame decoded once.

Chunk boundaries depend only on frame indices (a small first chunk, then doubling up to `chunk_frames`:
codec_stream.next_chunk_frames), never on timing,
so a stream's audio is the same however the talker and codec interleave, and a non-streamed response
(built from the same chunks) equals the concatenated stream. Every stream holds a slot of the codec's
incremental decoder (serving/model/codec_stream.py), which carries each layer's state from chunk to chunk:
the chunks together equal the one-shot decode of the stream. For in-context voice cloning, the last
reference codes (at most --left-context-frames of them) prime the state before the first chunk, unheard, as
the official pipeline prepends them and cuts the waveform of the reference prefix.

Slots are taken in arrival order when a stream's first chunk is due and given back when it retires; when all
are taken a stream waits (its frames keep arriving) until one frees, so the pool bounds memory, not streams.
On a GPU each call replays a CUDA graph of the step for the smallest (batch, frames) bucket that covers it
(codec_graphs.py); calls beyond every bucket, and all calls on a CPU or with --enforce-eager, run eagerly.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import numpy as np
import torch

from serving.engine.codec_graphs import CodecGraphReport, CodecGraphs, PrimeGraphs, pad_rows, run_step
from serving.engine.cuda_graphs import wait_sleeping
from serving.engine.lru import LRU
from serving.model.codec_stream import IncrementalCodecDecoder, next_chunk_frames

T = TypeVar("T")


def codec_kernels(decoder: torch.nn.Module, device: torch.device) -> bool:
    """On CUDA, run the vocoder's convolutions and SnakeBetas (triton_vocoder: window products with the residual
    units' activations and additions in their epilogues, in place) and the transformer's norms, rotary and
    LayerScale residual additions (triton_codec_transformer) as Triton kernels; elsewhere, or without Triton,
    the torch reference stays. Returns whether the kernels are in."""
    if device.type != "cuda":
        return False
    try:
        from serving.engine import triton_codec_transformer, triton_vocoder
    except ImportError:
        return False
    vocoder = triton_vocoder.install(decoder)
    return triton_codec_transformer.install(decoder) and vocoder


@dataclass(frozen=True)
class CodecChunk:
    slot: int
    codes: np.ndarray  # (n, Q) the chunk's new frames
    first: bool  # starts the stream: the slot's state is discarded
    prime: np.ndarray | None = None  # (m, Q) reference codes that precede the first frame, not heard


@dataclass
class CodecStream:
    """One request's codes on their way to audio."""

    first_chunk_frames: int
    chunk_frames: int
    prime_codes: np.ndarray  # (n, Q) reference codes decoded before the first frame (ICL), samples dropped
    pending: list[np.ndarray] = field(default_factory=list)  # generated frames not yet decoded, each (Q,)
    decoded_frames: int = 0
    finished: bool = False  # the talker will add no more frames
    slot: int | None = None  # its state in the codec's pool, from its first chunk until it retires
    due_since: float | None = None  # when its next chunk's frames were all there (engine's codec_wait phase)
    audio_until: float | None = None  # when its audio so far runs out for a listener who began at the first chunk

    def deadline(self) -> float:
        """When this stream's next chunk is needed: at once (since it came due) before any audio went out, else
        when the audio already out runs out. The codec serves the earliest deadlines first, so a stream's first
        chunk does not wait behind steady streams' chunks that have seconds of audio in hand."""
        return self.due_since if self.audio_until is None else self.audio_until

    def delivered(self, at: float, seconds: float) -> None:
        """A chunk of `seconds` of audio went out at `at` (playback resumes then if it had run dry)."""
        self.audio_until = max(at, self.audio_until or at) + seconds

    def next_chunk_size(self) -> int:
        return next_chunk_frames(self.decoded_frames, self.first_chunk_frames, self.chunk_frames)

    def due(self) -> bool:
        """Enough frames for the next chunk (or the last ones)."""
        return len(self.pending) >= self.next_chunk_size() or (self.finished and bool(self.pending))

    def ready(self) -> bool:
        return self.slot is not None and self.due()

    def next_chunk_len(self) -> int:
        """Frames the next chunk takes: its size, or what is left at the end."""
        return min(self.next_chunk_size(), len(self.pending))

    def take_chunk(self) -> CodecChunk:
        """The next chunk (the first one carries the priming codes); advances the stream."""
        n = self.next_chunk_len()
        new = np.stack(self.pending[:n])
        del self.pending[:n]
        first = self.decoded_frames == 0
        self.decoded_frames += n
        return CodecChunk(self.slot, new, first, self.prime_codes if first and len(self.prime_codes) else None)

    @property
    def done(self) -> bool:
        return self.finished and not self.pending


WARM_PRIME_FRAMES = 128  # longest reference whose priming shapes warmup meets (longer: at first use)
URGENT_CALL_FRAMES = 400  # most rows x frames of a call that carries audio needed soon: 16 steady chunks, ~16 ms on an H100


def needed_by(stream: CodecStream, wait: float) -> float:
    """When a stream's next chunk is needed: its deadline, or for a stream the talker is done with, `wait` after
    its chunk came due (nothing more will join it, and the response, streamed or not, ends with it)."""
    return min(stream.deadline(), stream.due_since + wait) if stream.finished else stream.deadline()


def next_batch(ready: list[T], limit: int, codec: Callable[[T], CodecStream], now: float,
               wait: float, others: int) -> tuple[list[T], float | None]:
    """The next codec call's rows (ordered by when each is needed, ties in their order), or none yet and when
    to look again.

    When the first is needed within 2 x `wait` (a first chunk, a final one, a listener low on audio) the call
    goes now, with as many rows in that order as keep it quick: at most URGENT_CALL_FRAMES rows x frames. Other
    chunks wait to share a call, which decodes more frames per ms (on an H100, 1 x 25 frames 0.15 ms per frame,
    16 x 25 0.04, 64 x 25 0.03: docs/performance.md), until `limit` are ready, the oldest has waited `wait`, or
    no other stream could join (`others`: streams in the codec stage whose next chunk is not ready); that call
    takes `limit` rows. `wait` 0 sends every call at once. Waiting with no one to wait for only postponed a
    lone stream's chunks to its end, where they ran one after another before its last (H100, one stream:
    7-12 ms between its last frame and its last chunk's call, docs/performance.md)."""
    if not ready:
        return [], None
    order = sorted(ready, key=lambda item: needed_by(codec(item), wait))[:limit]
    if needed_by(codec(order[0]), wait) <= now + 2 * wait:
        batch, frames = [], 0
        for item in order:
            frames = max(frames, codec(item).next_chunk_len())
            if batch and (len(batch) + 1) * frames > URGENT_CALL_FRAMES:
                break
            batch.append(item)
        return batch, None
    oldest = min(codec(item).due_since for item in ready)
    if len(ready) >= limit or now >= oldest + wait or others == 0:
        return order, None
    return [], min(oldest + wait, needed_by(codec(order[0]), wait) - 2 * wait)


def landing(flat: torch.Tensor | None, rows: int, samples: int,
            allocate: Callable[[int], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, a contiguous (rows, samples) view of its start) for a codec call's waveforms, the flat buffer grown
    by `allocate` to the largest call seen. Contiguous
    because torch copies into a strided CPU target through a pageable temporary, and a copy from the GPU into
    pageable memory blocks the host until the stream is done: a (rows, samples) corner of a 2-D buffer was strided
    for every call shorter than the longest seen, so the codec thread sat in a blocking copy through the whole call
    (H100, short text at 128 streams: 2.7 ms per call, py-spy, docs/performance.md twenty-third pass)."""
    if flat is None or flat.numel() < rows * samples:
        flat = allocate(rows * samples)
    return flat, flat[: rows * samples].view(rows, samples)


def call_frames(lengths: list[int], shape: tuple[int, int] | None) -> tuple[int, int, int]:
    """(frames decoded, frames computed, of those the frames of rows that only fill the shape's batch) of a codec
    call of chunks of `lengths` frames that runs `shape` (rows, frames), or its own shape (its rows by its longest
    chunk) where None. Computed less decoded is the padding: the rows' share says whether finer batch buckets
    would cut it, the rest (chunks shorter than the call's longest) whether grouping chunks by length would."""
    rows, frames = shape if shape is not None else (len(lengths), max(lengths))
    return sum(lengths), rows * frames, (rows - len(lengths)) * frames


def padding_shares(decoded: float, computed: float, padding_rows: float) -> dict[str, float]:
    """Shares of the frames the codec computed: all padding, rows that only fill a call's batch, and chunks
    shorter than their call's longest (the rest of the padding)."""
    return {"padded_share": round(1 - decoded / computed, 3), "rows_share": round(padding_rows / computed, 3),
            "lengths_share": round((computed - padding_rows - decoded) / computed, 3)}


class CodecRunner:
    """The codec's state pool and the batched decode of chunks on the codec's device.

    Rows of one step differ in slot, position and length (right-padded; the decoder is causal). Priming codes
    go through the pool's prime() first (the transformer over all of them, the vocoder over its receptive
    field only), so a cloned stream's first chunk is an ordinary row. Priming pads to a few shapes; with graphs,
    those that warm-up met replay a graph of their own (codec_graphs.PrimeGraphs), longer references prime
    eagerly; the rows then replay a graph like any other.
    """

    def __init__(self, decoder: torch.nn.Module, device: torch.device, num_quantizers: int, num_slots: int,
                 graph_buckets: tuple[tuple[int, int], ...] = (), graph_budget_bytes: int | None = None,
                 primed_cache_size: int = 32):
        """graph_buckets: (batch, frames) shapes to capture at warm-up (none: every call runs eagerly);
        graph_budget_bytes: the most memory they may take (None: no limit), the largest dropped first;
        primed_cache_size: states after priming kept, one per distinct reference (see _prime)."""
        self.pool = IncrementalCodecDecoder(decoder, num_slots)
        self.device = device
        self.num_quantizers = num_quantizers
        self.samples_per_frame = decoder.samples_per_frame
        self._free = list(range(num_slots - 1, -1, -1))
        self.graphs = CodecGraphs(self.pool, list(graph_buckets), num_quantizers, device) if graph_buckets else None
        self.graph_budget_bytes = graph_budget_bytes
        self.codec_kernels = codec_kernels(decoder, device)
        decoder.quantizer.tabulate()  # on every device: the released codec's table is 32 MB in bfloat16, quick to build
        self._host: torch.Tensor | None = None  # flat landing buffer of the waveforms (pinned on a GPU, see landing)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._primed = LRU(primed_cache_size)  # reference codes' hash -> the state priming leaves
        self.prime_graphs: PrimeGraphs | None = None  # made at warm-up for voice clone models (see warmup)
        # Frames served since warm-up, and frames computed for them: a call runs the cheapest captured shape that
        # covers its rows and its longest chunk, so the two differ by the padding (/metrics)
        self.frames_decoded = self.frames_computed = self.frames_padding_rows = 0

    @property
    def num_slots(self) -> int:
        return self.pool.num_slots

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def assign(self, stream: CodecStream) -> bool:
        """Give the stream a slot if one is free (called on the engine's loop, like release)."""
        if stream.slot is None and self._free:
            stream.slot = self._free.pop()
        return stream.slot is not None

    def release(self, stream: CodecStream) -> None:
        if stream.slot is not None:
            self._free.append(stream.slot)
            stream.slot = None

    @property
    def graph_report(self) -> CodecGraphReport | None:
        return self.graphs.report if self.graphs is not None else None

    def describe(self) -> dict:
        """The codec's side of the engine's configuration (GET /health): device, dtype, state, graphs."""
        param = next(self.pool.decoder.parameters())
        d = {"codec_device": str(param.device), "codec_dtype": str(param.dtype).removeprefix("torch."),
             "codec_slots": self.num_slots, "codec_kernels": self.codec_kernels,
             "codec_table_bytes": self.pool.decoder.quantizer.table_bytes,
             "codec_state_bytes": self.pool.state_bytes_per_slot * (self.num_slots + 1)}
        report = self.graph_report or CodecGraphReport((), (), 0, self.graph_budget_bytes)
        return d | report.describe() | (self.prime_graphs.describe() if self.prime_graphs is not None else {})

    @torch.inference_mode()
    def decode(self, chunks: list[CodecChunk]) -> list[np.ndarray]:
        """One float32 waveform per chunk: its new frames' samples."""
        if not chunks:
            return []
        self.pool.check_chunks([c.slot for c in chunks], [torch.from_numpy(c.codes) for c in chunks])
        self._prime([c for c in chunks if c.prime is not None])
        rows = [(c.slot, c.codes, c.first and c.prime is None) for c in chunks]
        lengths = [len(c.codes) for c in chunks]
        longest = max(lengths)
        bucket = self.graphs.covering(len(rows), longest) if self.graphs is not None else None
        decoded, computed, padding_rows = call_frames(lengths, bucket)
        self.frames_decoded += decoded
        self.frames_computed += computed
        self.frames_padding_rows += padding_rows
        if bucket is not None:
            wav = self.graphs.replay(bucket, *pad_rows(rows, *bucket, self.pool.scratch_slot, self.num_quantizers))
        else:
            codes, meta = pad_rows(rows, len(rows), longest, self.pool.scratch_slot, self.num_quantizers)
            wav = run_step(self.pool, codes.to(self.device), meta.to(self.device))
        spf = self.samples_per_frame
        self._host, host = landing(self._host, len(rows), longest * spf, self._allocate)
        host.copy_(wav[: len(rows), : host.shape[1]], non_blocking=self._copied is not None)
        if self._copied is not None:
            wait_sleeping(self._copied)
        return [host[i, : n * spf].numpy().copy() for i, n in enumerate(lengths)]

    def _prime(self, chunks: list[CodecChunk]) -> None:
        """Prime each chunk's slot with its reference codes. The state priming leaves depends on those codes
        alone, so it is kept per distinct reference (LRU) and copied into the next slot that the same reference
        primes: a voice clone request then costs its priming (an eager pass over the reference) once per voice,
        not once per request. A call's chunks that share a new reference prime it once too (a first wave of 128
        clones of 8 voices reaches the codec as 64-row calls: 8 rows to prime, not 64)."""
        fresh: dict[str, list[CodecChunk]] = {}
        restored: list[tuple[int, list[torch.Tensor]]] = []
        for c in chunks:
            key = hashlib.sha1(c.prime.astype(np.int64).tobytes()).hexdigest()
            state = self._primed.get(key)
            if state is None:
                fresh.setdefault(key, []).append(c)
            else:
                restored.append((c.slot, state))
        if fresh:
            batch = self.pool.prime_batch([(same[0].slot, torch.from_numpy(same[0].prime)) for same in fresh.values()])
            if self.prime_graphs is None or not self.prime_graphs.run(*batch):
                self.pool.prime_padded(*batch)
        for key, same in fresh.items():
            state = self.pool.snapshot(same[0].slot)
            self._primed.put(key, state)
            restored += [(c.slot, state) for c in same[1:]]
        self.pool.restore([slot for slot, _ in restored], [state for _, state in restored])

    def _allocate(self, n: int) -> torch.Tensor:
        """The waveforms' landing buffer (see landing): on a GPU pinned, so that the copies are asynchronous and one
        polling wait that sleeps (cuda_graphs.wait_sleeping, as the talker's) covers them; a pageable copy of 64 x
        25 frames took 7 ms on an H100 (docs/performance.md)."""
        return torch.empty(n, dtype=torch.float32, pin_memory=self._copied is not None)

    def warmup(self, frame_counts: tuple[int, ...], prime_frames: int = 0) -> None:
        """Decode silence at the chunk sizes streams use (allocations, kernel selection), prime at the shapes of
        references of up to prime_frames frames (voice clone models; at most WARM_PRIME_FRAMES, a 10 s clip),
        then capture the graphs; every stream starts its slot afresh or primed, so what this leaves in the
        slots is never heard."""
        for frames in frame_counts:
            zeros = np.zeros((frames, self.num_quantizers), dtype=np.int64)
            self.decode([CodecChunk(0, zeros, True)])
        prime_frames = min(prime_frames, WARM_PRIME_FRAMES)
        self.pool.warm_prime(prime_frames)
        if self.graphs is not None and prime_frames:
            self.prime_graphs = PrimeGraphs(self.pool, self.pool.prime_shapes(prime_frames), self.num_quantizers,
                                            self.device)
        if self.graphs is not None:
            # cuDNN times its convolution algorithms for the buckets' fixed shapes and the graphs keep the fastest
            # (measured 10-30% per call on an H100); only here: eager calls (long references' priming, oversized
            # batches) have shapes that follow the input and would pay a new search for every new length
            previous = torch.backends.cudnn.benchmark
            torch.backends.cudnn.benchmark = self.device.type == "cuda"
            try:
                self.graphs.capture_all(self.graph_budget_bytes)
                if self.prime_graphs is not None:
                    frame_graphs = self.graphs.frame_graphs
                    self.prime_graphs.capture_all(frame_graphs.pool if frame_graphs is not None else None)
            finally:
                torch.backends.cudnn.benchmark = previous
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.frames_decoded = self.frames_computed = self.frames_padding_rows = 0
