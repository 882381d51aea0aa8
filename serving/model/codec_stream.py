"""Incremental codec decoding: each frame is decoded once, with every layer's state carried from chunk to chunk.

Re-decoding left context for every chunk costs several times the codec's work per frame and, with fewer earlier
frames than the decoder's receptive field (580 frames for the released codec: 8 sliding-window layers compound),
only approximates the one-shot decode. Here each stream instead keeps, per slot of a fixed-size pool:
  - every causal conv's last (k - 1) * dilation inputs, and each transposed conv's last input (its kernel is
    twice its stride, so an input's samples overlap the next one's); SnakeBeta, norms and 1x1 convs are
    pointwise and keep nothing;
  - every transformer layer's keys (before RoPE) and values of the last window - 1 frames, side by side, with
    how many of them are real (fewer at the start of a stream).
A chunk then runs the decoder's one traversal (`CodecDecoder.run`) over its new frames only, through a
`StreamStep` view that hands each layer its rows' state, so chunked output equals the one-shot decode.

One `step` decodes a batch of rows, each with its own slot, chunk length and position: rows are right-padded to
a common frame count (causal, so padding after a row's frames changes none of its samples) and each row's new
state is gathered at its own chunk end, so a row with 0 new frames keeps its state unchanged. Rows that start a
stream zero their state inside the step. Everything is a fixed-shape device op on static pool buffers, with no
host sync, so a step can be captured as a CUDA graph per (batch, frames) bucket; rows that only pad a batch
bucket use `scratch_slot` with 0 new frames.

For in-context voice cloning the reference codes prime a slot: decode them as the stream's first chunk and
discard those samples (what the official pipeline does when it prepends them and cuts the waveform prefix).
`prime` reaches the same state for a fraction of the work: the transformer runs over every reference frame,
the convolutions after it (nearly all the work) only over the last `vocoder_receptive_frames` of them, all
that their final state depends on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from serving.model.codec_decoder import (Attention, CausalConv1d, CausalConvTranspose1d, CodecDecoder,
                                         Frames)

PRIME_ROWS = (1, 2, 4, 8, 16)  # priming batches pad to these rows (more rows: as many as there are)
PRIME_FRAMES = 32  # and to a multiple of these frames


def _prime_rows(n: int) -> int:
    return next((r for r in PRIME_ROWS if r >= n), n)


def next_chunk_frames(decoded_frames: int, first_chunk_frames: int, chunk_frames: int) -> int:
    """Frames in the next chunk of a stream that has `decoded_frames` so far: the first chunk, then each chunk twice
    the one before, up to chunk_frames (2, 4, 8, 16, 25, 25, ... for 2 and 25).

    A small first chunk gets audio out early; doubling keeps every later chunk due before the audio already sent
    has played out whenever frames come at least twice as fast as real time, and reaches the large steady chunk
    (few codec calls per second of audio) within a few chunks. Sizes depend only on frame counts, never timing."""
    size, total = first_chunk_frames, 0
    while total < decoded_frames and size != chunk_frames:
        total += size
        size = min(chunk_frames, 2 * size)
    return size


def chunk_plan(num_frames: int, first_chunk_frames: int, chunk_frames: int) -> list[int]:
    """The chunk sizes of a num_frames stream (the last one possibly short)."""
    sizes, done = [], 0
    while done < num_frames:
        sizes.append(min(next_chunk_frames(done, first_chunk_frames, chunk_frames), num_frames - done))
        done += sizes[-1]
    return sizes


class StreamStep(Frames):
    """The streaming view of one step's rows: their carried state in, their new state recorded for commit().

    The rows' whole state is gathered from the pool in one indexed read (and zeroed where a row starts), and
    each layer takes its part as a view; their new state goes back in one concatenation and one indexed write.
    Per layer that was an indexed read, a zero-filled scalar, a select, an index range and an indexed write, of
    the ~900 small kernels of a codec call on an H100 (docs/performance.md)."""

    def __init__(self, pool: "IncrementalCodecDecoder", slots_b: torch.Tensor, new_frames_b: torch.Tensor,
                 first_b: torch.Tensor):
        super().__init__()
        self.pool = pool
        self.slots_b = slots_b
        self.new_frames_b = new_frames_b
        self.first_b = first_b
        self.past_frames = pool.cache_frames
        # shared by the views at every rate (upsampled() copies): the rows' carried state (B, pool.width), each
        # layer's new state by its offset in it, and the rows' new count of real carried frames (the transformer's)
        self._rows = pool.state.index_select(0, slots_b).masked_fill_(first_b[:, None], 0)
        self.updates: dict[int, torch.Tensor] = {}
        self.history_update: list[torch.Tensor] = []
        self._indices: dict[tuple, torch.Tensor] = {}  # _record's gather indices, shared by the layers that match

    def _carried(self, key) -> torch.Tensor:
        return self.pool.part(key, self._rows)

    def _record(self, key, full: torch.Tensor, length: int, dim: int) -> None:
        """Record the `length` entries of each row of `full` (= [state | new inputs at this rate]) along `dim` that
        end where the row's new inputs end: its state after them. The index of the gather depends only on the
        rate, the length and the layout, so the layers that share those share it (fewer small kernels)."""
        index_key = (self.rate, length, full.dim(), dim % full.dim())
        index = self._indices.get(index_key)
        if index is None:
            shape = [1] * full.dim()
            shape[0], shape[dim] = -1, length
            end_b = self.new_frames_b if self.rate == 1 else self.new_frames_b * self.rate
            index = end_b.view(-1, *[1] * (full.dim() - 1)) + self.pool.steps[length].view(shape)
            self._indices[index_key] = index
        target = list(full.shape)
        target[dim] = length
        self.updates[self.pool.slices[key][0]] = full.gather(dim, index.expand(target))

    def valid(self) -> tuple[torch.Tensor, int] | None:
        return (self.new_frames_b, self.rate) if self.wanted_only else None

    def history(self, module: nn.Module, x_bcl: torch.Tensor, n: int) -> torch.Tensor:
        return self._carried(module)

    def filled(self, module: nn.Module, full: torch.Tensor, n: int) -> torch.Tensor:
        """Records the rows' state after their new inputs, now that `full` holds them."""
        self._record(module, full, n, dim=-1)
        return full

    def keys_values(self, module: nn.Module, kv_b2htd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv_all = torch.cat([self._carried((module, "kv")), kv_b2htd], dim=3)
        self._record((module, "kv"), kv_all, self.past_frames, dim=3)
        return kv_all[:, 0], kv_all[:, 1]

    def attention_mask(self, num_frames: int, window: int, device) -> torch.Tensor:
        """(B, 1, T, past + T): causal within the window, and carried keys only where the row has real ones (its
        frames decoded so far, none when it starts here)."""
        past = self.past_frames
        keys = torch.arange(past + num_frames, device=device)
        distance_tm = (past + torch.arange(num_frames, device=device))[:, None] - keys[None, :]
        allowed_tm = (distance_tm >= 0) & (distance_tm < window)
        history_b = torch.where(self.first_b, 0, self.pool.history.index_select(0, self.slots_b))
        self.history_update[:] = [(history_b + self.new_frames_b).clamp(max=past)]
        real_bm = keys[None, :] >= past - history_b[:, None]
        return (allowed_tm[None] & real_bm[:, None, :])[:, None]

    def commit(self) -> None:
        """Write the rows' new state into their slots in one indexed copy (the scratch slot may appear more than
        once: it only ever receives zeros, its rows having 0 new frames and a fresh start). A step updates one
        contiguous run of the pool's layers, which are laid out in traversal order: all of them, or priming's
        first half (pre_conv and the transformer) then its second (the vocoder)."""
        if self.updates:
            offsets = sorted(self.updates)
            rows = torch.cat([self.updates[o].reshape(len(self.slots_b), -1) for o in offsets], dim=1)
            start = offsets[0]
            if offsets[-1] + self.updates[offsets[-1]][0].numel() - start != rows.shape[1]:  # a gap between them
                raise RuntimeError("a codec step updated layers that are not one contiguous run of its state")
            self.pool.state[:, start:start + rows.shape[1]].index_copy_(0, self.slots_b, rows)
        for counts in self.history_update:
            self.pool.history.index_copy_(0, self.slots_b, counts)


class IncrementalCodecDecoder:
    """A pool of `num_slots` stream states (plus one scratch slot) for one CodecDecoder, on its device and dtype.

    A slot's state is one row of `state` (slot, width): each layer's part is a slice of it (`slices`: offset and
    shape by conv module, or (attention module, "kv"): keys then values; `part` views it); `history` counts each
    slot's real carried frames. Memory per slot (released codec): 8 layers x 2 x 71 frames x 1024 for keys/values
    plus ~136k values of convolution state, ~5 MB in fp32 (see state_bytes_per_slot).
    """

    def __init__(self, decoder: CodecDecoder, num_slots: int):
        if num_slots < 1:
            raise ValueError("the codec state pool needs at least one slot")
        self.decoder = decoder
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        self.samples_per_frame = decoder.samples_per_frame
        self.cache_frames = decoder.config.sliding_window - 1
        param = next(decoder.parameters())
        rows = num_slots + 1
        self.slices: dict[object, tuple[int, torch.Size]] = {}
        self.width = 0  # of a slot's row, grown by _slice
        for module in decoder.modules():
            if isinstance(module, CausalConv1d) and module.left_pad:
                self._slice(module, module.conv.in_channels, module.left_pad)
            elif isinstance(module, CausalConvTranspose1d) and module.history:
                self._slice(module, module.conv.in_channels, module.history)
            elif isinstance(module, Attention):
                self._slice((module, "kv"), 2, module.num_kv_heads, self.cache_frames, module.head_dim)
        self.state = torch.zeros((rows, self.width), dtype=param.dtype, device=param.device)
        # 0..n-1 for each state length n: where a row's new state starts in its inputs (no arange per step)
        lengths = {shape[1] for _, shape in self.slices.values() if len(shape) == 2} | {self.cache_frames}
        self.steps = {n: torch.arange(n, device=param.device) for n in lengths}
        # real frames among each slot's carried keys/values: min(frames decoded so far, cache_frames)
        self.history = torch.zeros(rows, dtype=torch.long, device=param.device)

    def _slice(self, key, *shape: int) -> None:
        """The next part of a slot's row: `key`'s state of `shape`, after the parts before it."""
        self.slices[key] = (self.width, torch.Size(shape))
        self.width += self.slices[key][1].numel()

    def part(self, key, rows: torch.Tensor | None = None) -> torch.Tensor:
        """`key`'s state in every row of `rows` (default: the pool's), a view (rows, *shape)."""
        offset, shape = self.slices[key]
        rows = self.state if rows is None else rows
        return rows[:, offset:offset + shape.numel()].view(-1, *shape)

    @property
    def state_bytes_per_slot(self) -> int:
        return self.width * self.state.element_size() + self.history.element_size()

    def snapshot(self, slot: int) -> list[torch.Tensor]:
        """A copy of one slot's whole state (what a stream has decoded so far, as far as the future hears it)."""
        return [self.state[slot].clone(), self.history[slot].clone()]

    def restore(self, slots: list[int], states: list[list[torch.Tensor]]) -> None:
        """Put snapshots' states into slots (distinct): each then continues exactly as its snapshot's slot would
        have. One stack and one indexed copy for all the slots (a first wave's 64-row codec call of clones
        restores 64 slots)."""
        if not slots:
            return
        index = torch.tensor(slots, device=self.history.device)
        for i, buffer in enumerate((self.state, self.history)):
            buffer.index_copy_(0, index, torch.stack([state[i] for state in states]))

    @torch.inference_mode()
    def step(self, codes_btq: torch.Tensor, slots_b: torch.Tensor, new_frames_b: torch.Tensor,
             first_b: torch.Tensor) -> torch.Tensor:
        """Decode the next chunk of each row's stream and advance its slot.

        codes (B, T, Q) on the decoder's device: row b's first new_frames_b[b] frames are its chunk, the rest
        padding; slots_b (B,) long: distinct slots in [0, num_slots), or scratch_slot (= num_slots) for rows
        that only pad a batch bucket (0 new frames, first True); first_b (B,) bool: the chunk starts the row's stream (its slot's state is discarded).
        Returns (B, T * samples_per_frame): row b's first new_frames_b[b] * samples_per_frame samples are its
        chunk's, equal to the one-shot decode of the row's whole stream at those frames.
        """
        frames = StreamStep(self, slots_b, new_frames_b, first_b)
        wav = self.decoder.run(codes_btq, frames)
        frames.commit()
        return wav

    def decode(self, chunks: list[tuple[int, torch.Tensor, bool]]) -> list[torch.Tensor]:
        """Eager convenience over step(): [(slot, codes (n, Q), first), ...] -> each chunk's waveform
        (n * samples_per_frame,) on the decoder's device."""
        if not chunks:
            return []
        codes, slots, lengths = self._batch([(slot, codes) for slot, codes, _ in chunks])
        first = torch.tensor([first for _, _, first in chunks], device=slots.device)
        wav = self.step(codes, slots, lengths, first)
        return [wav[i, : n * self.samples_per_frame] for i, n in enumerate(lengths.tolist())]

    @torch.inference_mode()
    def prime(self, chunks: list[tuple[int, torch.Tensor]]) -> None:
        """Start each slot's stream with reference codes [(slot, codes (n, Q)), ...]: the state that decoding
        them as a first chunk leaves, without their samples. The convolutions after the transformer run only
        over each row's last vocoder_receptive_frames latents, from zero state: the samples of those frames
        are inexact, but the state at their end depends on nothing earlier."""
        if chunks:
            self.prime_padded(*self.prime_batch(chunks))

    def prime_batch(self, chunks: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """prime()'s inputs on the device, padded to its shape (_prime_shape): codes (rows, frames, Q), slots (rows,),
        lengths (rows,); padding rows are the scratch slot's, of no frames."""
        return self._prime_shape(*self._batch(chunks))

    def prime_padded(self, codes: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor) -> None:
        """prime()'s device work on a padded batch (prime_batch): no host reads, so a CUDA graph can hold it."""
        first = torch.ones_like(slots, dtype=torch.bool)
        head = StreamStep(self, slots, lengths, first)
        latents = self.decoder.latents(codes, head)                                   # (B, latent, T)
        keep = min(self.decoder.vocoder_receptive_frames, latents.shape[-1])
        start_b = (lengths - keep).clamp(min=0)
        index = (start_b[:, None] + torch.arange(keep, device=slots.device)).clamp(max=latents.shape[-1] - 1)
        tail = latents.gather(2, index[:, None, :].expand(-1, latents.shape[1], -1))  # right-padded past a row's end
        tail_step = StreamStep(self, slots, lengths - start_b, first)
        self.decoder.vocode(tail, tail_step)
        head.commit()
        tail_step.commit()

    def _prime_shape(self, codes: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor):
        """Pad a priming batch to PRIME_ROWS rows (scratch-slot rows of no frames, as a step's padding) and
        to a multiple of PRIME_FRAMES frames. Priming is eager, and on a GPU an eager pass at a new shape pays
        for cuDNN's plans: ~300 ms per first meeting of a voice on an H100 (each reference has its own length),
        against ~1 ms of work; warm_prime() meets these few shapes at start-up."""
        rows = _prime_rows(len(slots))
        frames = -(-codes.shape[1] // PRIME_FRAMES) * PRIME_FRAMES
        pad = rows - len(slots)
        codes = F.pad(codes, (0, 0, 0, frames - codes.shape[1], 0, pad))
        slots = torch.cat([slots, slots.new_full((pad,), self.scratch_slot)])
        return codes, slots, torch.cat([lengths, lengths.new_zeros(pad)])

    def prime_shapes(self, max_frames: int) -> list[tuple[int, int]]:
        """The padded (rows, frames) shapes of priming calls of references up to max_frames frames."""
        rows = sorted({_prime_rows(min(r, self.num_slots)) for r in PRIME_ROWS})  # those calls can have
        return [(r, f) for r in rows for f in range(PRIME_FRAMES, max_frames + PRIME_FRAMES, PRIME_FRAMES)]

    def warm_prime(self, max_frames: int) -> None:
        """Prime each shape of prime_shapes(max_frames) once, into the first slots (every stream starts its slot
        afresh or primed, so what this leaves there is never heard)."""
        for rows, frames in self.prime_shapes(max_frames):
            zeros = torch.zeros((frames, self.decoder.config.num_quantizers), dtype=torch.long)
            self.prime([(slot, zeros) for slot in range(min(rows, self.num_slots))])

    def check_chunks(self, slots: list[int], rows: list[torch.Tensor]) -> None:
        """Clear errors on the host for what would be a device assert or a corrupted slot on the GPU: distinct
        slots in range, each chunk's codes (frames, Q) with at least one frame, all in the codebook. The codes are
        checked together, in one pass: a pass per chunk took ~4 ms of each codec call's host time at 128 streams
        of short text on an H100 host (py-spy, docs/performance.md, twenty-fourth pass)."""
        if len(set(slots)) != len(slots) or not all(0 <= s < self.num_slots for s in slots):
            raise ValueError(f"slots must be distinct and in [0, {self.num_slots}), got {slots}")
        q = self.decoder.config.num_quantizers
        for r in rows:
            if r.dim() != 2 or r.shape[1] != q:
                self.decoder.check_codes(r[None])  # raises its message for the shape
        lengths = [len(r) for r in rows]
        if min(lengths) < 1:
            raise ValueError(f"every chunk needs at least one frame, got lengths {lengths}")
        self.decoder.check_codes(torch.cat(rows)[None])

    def _batch(self, chunks: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes (B, T, Q) right-padded, slots (B,), lengths (B,)) on the device, checked and assembled on the
        host (codes given on a device are read back) and sent in one copy each."""
        slots = [slot for slot, _ in chunks]
        rows = [torch.as_tensor(codes, device="cpu") for _, codes in chunks]
        self.check_chunks(slots, rows)
        lengths = [len(r) for r in rows]
        batch = torch.zeros((len(rows), max(lengths), self.decoder.config.num_quantizers), dtype=torch.long)
        for i, r in enumerate(rows):
            batch[i, : len(r)] = r
        device = self.history.device
        return batch.to(device), torch.tensor(slots, device=device), torch.tensor(lengths, device=device)
