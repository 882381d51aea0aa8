"""Stage 1: codes -> audio, chunk by chunk, batched across requests.

Chunk boundaries depend only on frame indices (a small first chunk, then `chunk_frames`), never on timing,
so a stream's audio is the same however the talker and codec interleave, and a non-streamed response
(built from the same chunks) equals the concatenated stream. Each chunk re-decodes up to
`left_context_frames` earlier frames as context, so chunk boundaries are seamless; for in-context voice
cloning the reference codes are that context for the first chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class CodecStream:
    """One request's codes on their way to audio."""

    first_chunk_frames: int
    chunk_frames: int
    left_context_frames: int
    context_codes: np.ndarray  # (n, Q) frames before the next chunk: reference codes, then generated ones
    pending: list[np.ndarray] = field(default_factory=list)  # generated frames not yet decoded, each (Q,)
    decoded_frames: int = 0
    finished: bool = False  # the talker will add no more frames

    def next_chunk_size(self) -> int:
        return self.first_chunk_frames if self.decoded_frames == 0 else self.chunk_frames

    def ready(self) -> bool:
        return len(self.pending) >= self.next_chunk_size() or (self.finished and bool(self.pending))

    def take_chunk(self) -> tuple[np.ndarray, np.ndarray]:
        """(context (c, Q), new (n, Q)) for the next chunk; advances the stream."""
        n = min(self.next_chunk_size(), len(self.pending))
        new = np.stack(self.pending[:n])
        del self.pending[:n]
        context = self.context_codes[len(self.context_codes) - min(self.left_context_frames,
                                                                   len(self.context_codes)):]
        keep = np.concatenate([context, new])[-self.left_context_frames:] if self.left_context_frames else new[:0]
        self.context_codes = keep
        self.decoded_frames += n
        return context, new

    @property
    def done(self) -> bool:
        return self.finished and not self.pending


class CodecRunner:
    """Decodes a batch of chunks in one forward pass on the codec's device.

    Rows differ in context length (left-padded, masked by the decoder) and in new frames (right-padded:
    the decoder is causal, so padding after a row's frames never changes that row's samples).
    """

    def __init__(self, decoder: torch.nn.Module, device: torch.device, num_quantizers: int):
        self.decoder = decoder
        self.device = device
        self.num_quantizers = num_quantizers
        self.samples_per_frame = decoder.samples_per_frame

    @torch.inference_mode()
    def decode(self, chunks: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
        """[(context, new), ...] -> one float32 waveform per chunk, len(new) * samples_per_frame samples."""
        max_ctx = max(len(c) for c, _ in chunks)
        max_new = max(len(n) for _, n in chunks)
        codes = np.zeros((len(chunks), max_ctx + max_new, self.num_quantizers), dtype=np.int64)
        for i, (ctx, new) in enumerate(chunks):
            row = np.concatenate([ctx, new])
            codes[i, max_ctx - len(ctx): max_ctx + len(new)] = row
        context_b = torch.tensor([len(c) for c, _ in chunks], dtype=torch.long)
        codes_t = torch.from_numpy(codes).to(self.device)
        wav = self.decoder.decode_chunk(codes_t, context_b).float().cpu().numpy()
        return [wav[i, : len(new) * self.samples_per_frame] for i, (_, new) in enumerate(chunks)]

    def warmup(self, frame_counts: tuple[int, ...]) -> None:
        """Decode silence at the chunk sizes streams use (allocations, kernel selection)."""
        for frames in frame_counts:
            zeros = np.zeros((frames, self.num_quantizers), dtype=np.int64)
            self.decode([(zeros[:0], zeros)])
