"""Incremental codec decoding (serving/model/codec_stream.py): a stream decoded chunk by chunk with carried state
equals the one-shot decode, in batches whose rows have their own slots, chunk sizes and start/end times."""

import dataclasses

import pytest
import torch

from serving.model.codec_config import released_codec_config, tiny_codec_config
from serving.model.codec_decoder import CodecDecoder, init_random_
from serving.model.codec_stream import PRIME_FRAMES, PRIME_ROWS, IncrementalCodecDecoder, StreamStep

Q = 16
TOL = 1e-4


def _decoder(cfg):
    dec = CodecDecoder(cfg).eval()
    init_random_(dec, torch.Generator().manual_seed(0))
    return dec


@pytest.fixture(scope="module")
def small_window():
    """Window 12 and 64 samples per frame: an 80-frame stream slides the window many times, cheaply."""
    return _decoder(dataclasses.replace(tiny_codec_config().decoder, sliding_window=12, upsample_rates=(2, 2, 2, 2)))


@pytest.fixture(scope="module")
def real_window():
    """The released window (72) and upsampling (1920 samples per frame, kernels 2r), at tiny widths."""
    return _decoder(tiny_codec_config().decoder)


def codes(n, seed, rows=None):
    shape = (n, Q) if rows is None else (rows, n, Q)
    return torch.randint(0, 2048, shape, generator=torch.Generator().manual_seed(seed))


def one_shot(decoder, c):
    with torch.inference_mode():
        return decoder(c[None])[0]


def stream(pool, slot, c, sizes, fresh=True):
    """Decode c (T, Q) alone in `slot`, chunk sizes taken from `sizes` (the last repeats) until T is covered;
    fresh=False continues the slot's stream instead of starting one."""
    pieces, start, i = [], 0, 0
    while start < len(c):
        n = min(sizes[min(i, len(sizes) - 1)], len(c) - start)
        pieces.append(pool.decode([(slot, c[start:start + n], fresh and start == 0)])[0])
        start, i = start + n, i + 1
    return torch.cat(pieces)


def max_dev(a, b):
    assert a.shape == b.shape
    return float((a - b).abs().max())


@pytest.mark.parametrize("sizes", [[1, 7], [3, 25], [4, 25, 5, 11, 1, 2], [80]])
def test_stream_equals_one_shot_small_window(small_window, sizes):
    c = codes(80, 1)
    pool = IncrementalCodecDecoder(small_window, num_slots=2)
    assert max_dev(stream(pool, 1, c, sizes), one_shot(small_window, c)) < TOL


@pytest.mark.parametrize("sizes", [[4, 25], [1, 13, 2, 30]])
def test_stream_equals_one_shot_real_window_and_upsampling(real_window, sizes):
    c = codes(110, 2)  # > 72 frames: the carried keys/values window slides
    pool = IncrementalCodecDecoder(real_window, num_slots=1)
    assert max_dev(stream(pool, 0, c, sizes), one_shot(real_window, c)) < TOL


def test_stream_equals_one_shot_at_the_released_size():
    dec = CodecDecoder(released_codec_config().decoder).eval()
    init_random_(dec, torch.Generator().manual_seed(0))
    c = codes(6, 3)
    pool = IncrementalCodecDecoder(dec, num_slots=1)
    whole = one_shot(dec, c)
    assert max_dev(stream(pool, 0, c, [1, 2, 3]), whole) < TOL
    assert float(whole.std()) > 0.05  # the random weights make real audio-like values, not a flat line


def test_batched_rows_with_own_slots_sizes_and_lifetimes(small_window):
    """Three streams in a pool of 3: B starts while A runs, A ends and its slot is reused by C; each step mixes
    rows at different positions and chunk sizes (right-padded); every stream equals its own one-shot decode."""
    spf = small_window.samples_per_frame
    pool = IncrementalCodecDecoder(small_window, num_slots=3)
    streams = {"A": (codes(40, 10), 0), "B": (codes(50, 11), 2), "C": (codes(33, 12), 0)}
    # per step: {stream: frames}; a stream's first entry starts it
    steps = [{"A": 3}, {"A": 25, "B": 1}, {"A": 12, "B": 4}, {"B": 25, "C": 2}, {"B": 20, "C": 25}, {"C": 6}]
    done = {name: 0 for name in streams}
    out = {name: [] for name in streams}
    for step in steps:
        chunks = [(streams[n][1], streams[n][0][done[n]:done[n] + k], done[n] == 0) for n, k in step.items()]
        for name, wav in zip(step, pool.decode(chunks)):
            assert wav.shape == (step[name] * spf,)
            out[name].append(wav)
            done[name] += step[name]
    for name, (c, _) in streams.items():
        assert done[name] == len(c)
        assert max_dev(torch.cat(out[name]), one_shot(small_window, c)) < TOL, name


def test_padding_rows_and_idle_rows_leave_state_untouched(small_window):
    """A step row with 0 new frames (an idle slot, or the scratch slot padding a batch bucket) changes no state,
    and padding frames after a row's chunk change none of its samples."""
    spf = small_window.samples_per_frame
    pool = IncrementalCodecDecoder(small_window, num_slots=2)
    c = codes(30, 20)
    first = pool.decode([(0, c[:10], True)])[0]
    junk = codes(8, 21, rows=3)
    junk[0, :5] = c[10:15]
    wav = pool.step(junk, torch.tensor([0, 1, pool.scratch_slot]), torch.tensor([5, 0, 0]),
                    torch.tensor([False, False, True]))
    rest = pool.decode([(0, c[15:], False)])[0]
    streamed = torch.cat([first, wav[0, : 5 * spf], rest])
    assert max_dev(streamed, one_shot(small_window, c)) < TOL
    assert float(pool.state[pool.scratch_slot].abs().max()) == 0
    assert int(pool.history[1]) == 0 and int(pool.history[pool.scratch_slot]) == 0


def test_reference_codes_prime_the_state(real_window):
    """Voice cloning: after prime() with the reference codes (or decoding them as a first chunk and dropping
    the samples), the generated frames' samples are those of the one-shot decode of [reference | generated].
    prime() runs the vocoder over the last 10 frames only: a 30-frame reference tests the cut, a 6-frame one a
    reference shorter than that, a 40-frame one a batch padded past one PRIME_FRAMES, primed together in one
    batch (three rows: a padding row in the scratch slot)."""
    spf = real_window.samples_per_frame
    assert real_window.vocoder_receptive_frames == 10
    refs, gen = {0: codes(30, 30), 1: codes(6, 32), 2: codes(40, 33)}, codes(29, 31)
    primed = IncrementalCodecDecoder(real_window, num_slots=3)
    primed.prime([(1, refs[1]), (0, refs[0]), (2, refs[2])])
    first_chunk = IncrementalCodecDecoder(real_window, num_slots=3)
    for slot, ref in refs.items():
        first_chunk.decode([(slot, ref, True)])
    for slot, ref in refs.items():
        expected = one_shot(real_window, torch.cat([ref, gen]))[len(ref) * spf:]
        for pool in (primed, first_chunk):
            assert max_dev(stream(pool, slot, gen, [4, 25], fresh=False), expected) < TOL, slot


def test_priming_runs_at_few_shapes_and_warm_prime_meets_them(small_window, monkeypatch):
    """A priming pass is eager: its batch pads to PRIME_ROWS rows and a multiple of PRIME_FRAMES frames, so a
    GPU builds its kernels' plans for few shapes, and warm_prime(72) meets every shape of references up to 72
    frames in the batches this pool's 4 slots can make (1, 2 or 4 rows)."""
    pool = IncrementalCodecDecoder(small_window, num_slots=4)
    shapes = []
    latents = small_window.latents
    monkeypatch.setattr(small_window, "latents", lambda c, step: (shapes.append(tuple(c.shape[:2])), latents(c, step))[1])
    pool.prime([(0, codes(5, 1)), (2, codes(33, 2)), (3, codes(17, 3))])
    pool.prime([(1, codes(70, 4))])
    assert shapes == [(PRIME_ROWS[2], 2 * PRIME_FRAMES), (1, 3 * PRIME_FRAMES)]
    shapes.clear()
    pool.warm_prime(72)
    assert sorted(shapes) == [(r, f * PRIME_FRAMES) for r in (1, 2, 4) for f in (1, 2, 3)]


def test_a_restarted_slot_forgets_its_previous_stream(small_window):
    pool = IncrementalCodecDecoder(small_window, num_slots=1)
    stream(pool, 0, codes(20, 40), [7])
    c = codes(20, 41)
    assert max_dev(stream(pool, 0, c, [3, 9]), one_shot(small_window, c)) < TOL


def test_snapshots_restored_into_several_slots_at_once(small_window):
    """restore() writes each slot its own snapshot in one indexed copy (a first wave of clones restores dozens of
    slots in one codec call); the other slots keep their state, and each restored stream continues as its
    snapshot's would have."""
    pool = IncrementalCodecDecoder(small_window, num_slots=6)
    for slot, seed in ((0, 1), (1, 2), (5, 3)):
        stream(pool, slot, codes(9 + slot, seed), [4])
    a, b, untouched = pool.snapshot(0), pool.snapshot(1), pool.snapshot(5)
    pool.restore([2, 3, 4], [a, b, a])
    for slot, expected in ((2, a), (3, b), (4, a), (5, untouched)):
        assert all(torch.equal(x, y) for x, y in zip(pool.snapshot(slot), expected)), slot
    more = codes(6, 9)
    assert torch.equal(stream(pool, 3, more, [3], fresh=False), stream(pool, 1, more, [3], fresh=False))


def test_step_traces_as_one_graph_without_host_syncs(small_window):
    """torch.compile with fullgraph=True fails on anything data-dependent on the host (.item(), Python branches
    on tensor values): a step that traces whole can be captured as a CUDA graph per (batch, frames) shape."""
    pool = IncrementalCodecDecoder(small_window, num_slots=2)
    compiled = torch.compile(pool.step, fullgraph=True, backend="eager", dynamic=False)
    c = codes(12, 50)
    args = (torch.tensor([0, pool.scratch_slot]), torch.tensor([4, 0]), torch.tensor([True, True]))
    wav = compiled(torch.stack([c[:4].repeat(3, 1), c[:12]]), *args)[0, : 4 * small_window.samples_per_frame]
    assert max_dev(wav, one_shot(small_window, c[:4])) < TOL


def test_a_step_reads_and_writes_the_pool_once_and_each_layer_sees_its_own_slice(small_window):
    """A slot's state is one row of the pool: each layer's part a slice of it (`part` views it), in
    traversal order, so a step gathers its rows once and commits one contiguous run; a step whose updates left a
    gap would misplace state, and says so."""
    pool = IncrementalCodecDecoder(small_window, num_slots=3)
    offsets = [offset for offset, _ in pool.slices.values()]
    assert offsets == sorted(offsets) and pool.state.shape == (4, pool.width)
    for key, (offset, shape) in pool.slices.items():
        view = pool.part(key)
        assert view.shape[1:] == shape and view.data_ptr() == pool.state[:, offset:].data_ptr()
    step = StreamStep(pool, torch.tensor([0, 1]), torch.tensor([2, 2]), torch.tensor([True, True]))
    convs = [key for key in pool.slices if not isinstance(key, tuple)]
    for module in (convs[0], convs[-1]):  # the first layer and the last: a gap between them
        channels, n = pool.slices[module][1]
        step.filled(module, torch.ones(2, channels, 10), n)
    with pytest.raises(RuntimeError, match="contiguous"):
        step.commit()


def test_state_size_of_the_released_codec():
    with torch.device("meta"):
        dec = CodecDecoder(released_codec_config().decoder)
    pool = IncrementalCodecDecoder(dec, num_slots=4)
    kv = 8 * 2 * 71 * 16 * 64 * 4  # layers x (keys, values) x window-1 frames x heads x head_dim x fp32
    assert kv < pool.state_bytes_per_slot < kv + 1_000_000
    assert pool.part(dec.pre_conv).shape == (5, 512, 2)  # 4 slots + scratch, kernel 3 -> 2 inputs


@pytest.mark.parametrize("chunks, message", [
    ([(0, codes(2, 0), True), (0, codes(2, 1), True)], "slots must be distinct"),
    ([(2, codes(2, 0), True)], r"slots must be distinct and in \[0, 2\)"),
    ([(0, codes(0, 0), True)], "at least one frame"),
    ([(0, torch.full((2, Q), 2048), True)], r"codes must lie in \[0, 2048\)"),
    ([(0, codes(2, 0)[:, :15], True)], r"codes must be \(batch, frames, 16\)"),
])
def test_bad_chunks_are_refused(small_window, chunks, message):
    pool = IncrementalCodecDecoder(small_window, num_slots=2)
    with pytest.raises(ValueError, match=message):
        pool.decode(chunks)


def test_pool_needs_a_slot(small_window):
    with pytest.raises(ValueError, match="at least one slot"):
        IncrementalCodecDecoder(small_window, num_slots=0)


def test_chunk_schedule_doubles_from_the_first_chunk_to_the_steady_one():
    from serving.model.codec_stream import chunk_plan, next_chunk_frames

    assert chunk_plan(103, 4, 25) == [4, 8, 16, 25, 25, 25]
    assert chunk_plan(60, 2, 25) == [2, 4, 8, 16, 25, 5]
    assert chunk_plan(10, 3, 5) == [3, 5, 2]  # 2 x 3 > 5: capped
    assert chunk_plan(40, 30, 25) == [30, 10]  # a request's first chunk may exceed the steady one
    assert chunk_plan(0, 2, 25) == []
    assert [next_chunk_frames(d, 2, 25) for d in (0, 2, 6, 14, 30, 55, 1000)] == [2, 4, 8, 16, 25, 25, 25]
