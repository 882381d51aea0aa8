"""Stage 1 with the real (tiny, random) codec decoder: chunk plans, slots of the incremental decoder's pool,
priming with reference codes, and batched decoding equal to each stream's one-shot decode."""

import numpy as np
import pytest
import torch

from serving.engine.codec_stage import (URGENT_CALL_FRAMES, CodecChunk, CodecRunner, CodecStream, landing, needed_by,
                                        next_batch)
from serving.model.codec_config import tiny_codec_config
from serving.model.codec_decoder import CodecDecoder, init_random_

Q = 16
SPF = 1920


@pytest.fixture(scope="module")
def decoder():
    dec = CodecDecoder(tiny_codec_config().decoder)
    init_random_(dec, torch.Generator().manual_seed(0))
    return dec.eval()


@pytest.fixture
def runner(decoder):
    return CodecRunner(decoder, torch.device("cpu"), Q, num_slots=3)


def codes(n, seed):
    return np.random.default_rng(seed).integers(0, 2048, size=(n, Q), dtype=np.int64)


def one_shot(decoder, frames):
    with torch.inference_mode():
        return decoder(torch.from_numpy(frames)[None])[0].numpy()


def new_stream(first=4, chunk=25, prime=None):
    return CodecStream(first, chunk, np.zeros((0, Q), np.int64) if prime is None else prime)


def drain(stream, frames, feed_sizes):
    """Feed `frames` in bursts of the given sizes, taking chunks whenever ready: returns (first, new) per chunk."""
    out, i = [], 0
    stream.slot = 0
    for size in feed_sizes:
        stream.pending.extend(frames[i:i + size])
        i += size
        if i >= len(frames):
            stream.finished = True
        while stream.ready():
            chunk = stream.take_chunk()
            out.append((chunk.first, len(chunk.codes)))
    assert stream.done
    return out


def test_chunk_boundaries_depend_on_frame_indices_not_arrival():
    frames = list(codes(60, 1))
    plans = [drain(new_stream(), frames, feed) for feed in ([1] * 60, [7] * 9, [60], [3, 50, 7])]
    assert all(p == plans[0] for p in plans)
    assert plans[0] == [(True, 4), (False, 8), (False, 16), (False, 25), (False, 7)]  # doubling to the steady 25


def test_a_stream_without_a_slot_waits():
    stream = new_stream()
    stream.pending.extend(codes(10, 2))
    assert stream.due() and not stream.ready()


def test_a_streams_deadline_is_when_its_audio_runs_out():
    stream = new_stream()
    stream.due_since = 5.0
    assert stream.deadline() == 5.0  # no audio out yet: needed since it came due
    stream.delivered(10.0, 2.0)
    assert stream.deadline() == 12.0
    stream.delivered(11.0, 2.0)  # queued behind the audio still playing
    assert stream.deadline() == 14.0
    stream.delivered(20.0, 1.0)  # the listener ran dry at 14 and resumes now
    assert stream.deadline() == 21.0


def waiting(due, audio_until=None, frames=25, decoded=100, finished=False):
    """A stream with a chunk of `frames` ready since `due` and audio out until `audio_until` (None: none yet)."""
    s = new_stream(2, 25)
    s.decoded_frames = 0 if audio_until is None else decoded
    s.pending.extend(codes(frames, 0))
    s.slot, s.due_since, s.audio_until, s.finished = 0, due, audio_until, finished
    return s


def test_codec_calls_serve_the_earliest_deadlines_first():
    """A new stream's first chunk goes before steady streams' chunks that have audio in hand, and a stream
    about to run dry before one that is not; ties keep arrival order."""
    steady, late, first, ahead = waiting(1.0, 4.0), waiting(1.0, 2.5), waiting(3.0, frames=2), waiting(1.0, 9.0)
    tie_a, tie_b = waiting(3.0, frames=2), waiting(3.0, frames=2)
    assert next_batch([steady, late, first, ahead], 3, lambda s: s, 3.0, 0.1, others=1) == ([late, first, steady], None)
    assert next_batch([tie_a, tie_b], 2, lambda s: s, 3.0, 0.1, others=1) == ([tie_a, tie_b], None)
    assert next_batch([(1, tie_b), (2, late)], 1, lambda item: item[1], 3.0, 0.1, others=1) == ([(2, late)], None)


def test_a_call_for_audio_needed_soon_stays_small():
    """First chunks of a burst share calls up to the row limit (2 frames each); 25-frame chunks needed soon go
    URGENT_CALL_FRAMES / 25 at a time, and a first chunk's call does not wait for a steady chunk's 25 frames."""
    firsts = [waiting(1.0, frames=2) for _ in range(127)]
    assert next_batch(firsts, 64, lambda s: s, 1.0, 0.1, others=1) == (firsts[:64], None)
    low = [waiting(1.0, 1.1) for _ in range(40)]  # 0.1 s of audio left
    batch, _ = next_batch(low, 64, lambda s: s, 1.0, 0.1, others=1)
    assert batch == low[: URGENT_CALL_FRAMES // 25]
    mixed = firsts[:10] + [waiting(1.0, 1.15)] + firsts[10:20]
    # the 25-frame row sorts last, left out
    assert next_batch(mixed, 64, lambda s: s, 1.0, 0.1, others=1)[0] == firsts[:20]


def test_chunks_with_audio_in_hand_wait_to_share_a_call():
    """Until `limit` are ready or the oldest has waited `wait`; then the call takes `limit` rows of any size."""
    steady = [waiting(1.0 + i / 100, 5.0 + i) for i in range(5)]
    assert next_batch(steady, 8, lambda s: s, 1.05, 0.1, others=1) == ([], 1.1)  # the oldest came due at 1.0
    assert next_batch(steady, 8, lambda s: s, 1.1, 0.1, others=1) == (steady, None)
    assert next_batch(steady, 4, lambda s: s, 1.05, 0.1, others=1) == (steady[:4], None)
    assert next_batch(steady, 8, lambda s: s, 1.05, 0.0, others=1) == (steady, None)  # no wait: at once
    soon = [waiting(1.0, 1.3)]  # its listener runs dry at 1.3: it goes at 1.1, 2 x wait before
    assert next_batch(soon, 8, lambda s: s, 1.05, 0.1, others=1) == ([], pytest.approx(1.1))
    assert next_batch(soon, 8, lambda s: s, 1.11, 0.1, others=1) == (soon, None)


def test_a_chunk_no_other_stream_could_join_goes_at_once():
    """Waiting to share a call is for other streams' chunks: with every stream in the codec stage ready, none
    can join, so the call goes now (a lone stream's chunks would otherwise wait to its end)."""
    steady = [waiting(1.0 + i / 100, 5.0 + i) for i in range(3)]
    assert next_batch(steady, 8, lambda s: s, 1.05, 0.1, others=0) == (steady, None)
    assert next_batch(steady, 8, lambda s: s, 1.05, 0.1, others=1) == ([], 1.1)


def test_a_finished_streams_last_chunk_goes_soon_after_its_first_chunks():
    """The talker is done with it: its response ends with this chunk, so it waits no more than `wait`, and
    first chunks that came due before it go first."""
    last = waiting(1.0, 9.0, frames=7, finished=True)
    first_before, first_after = waiting(0.99, frames=2), waiting(1.2, frames=2)
    assert needed_by(last, 0.1) == pytest.approx(1.1)
    assert next_batch([first_after, last, first_before], 8, lambda s: s, 1.2, 0.1, others=1)[0] == [first_before, last,
                                                                                          first_after]
    assert next_batch([last], 8, lambda s: s, 1.0, 0.1, others=1) == ([last], None)  # needed within 2 x wait: at once


def test_reference_codes_prime_the_first_chunk_only():
    ref = codes(30, 2)
    stream = new_stream(3, 25, prime=ref)
    stream.slot = 1
    stream.pending.extend(codes(30, 3))
    first, second = stream.take_chunk(), stream.take_chunk()
    assert (first.slot, first.first, len(first.codes)) == (1, True, 3) and np.array_equal(first.prime, ref)
    assert (second.first, second.prime, len(second.codes)) == (False, None, 6)


def test_every_calls_landing_views_are_contiguous_apart_and_the_buffer_grows_only_for_a_larger_call():
    """A call shorter than the longest seen (a 2-frame first chunk after 25-frame calls) lands in contiguous views:
    torch copies from the GPU into a strided host target through a blocking pageable temporary."""
    sizes = []

    def allocate(n):
        sizes.append(n)
        return torch.zeros(n)

    flat, view = landing(None, 4, 25 * 96, allocate)
    assert view.shape == (4, 25 * 96) and view.is_contiguous() and sizes == [4 * 25 * 96]
    for rows, samples in ((3, 2 * 96), (1, 25 * 96), (4, 25 * 96), (2, 8 * 96)):
        flat2, view = landing(flat, rows, samples, allocate)
        assert flat2 is flat and view.shape == (rows, samples) and view.is_contiguous()
        assert view.data_ptr() == flat.data_ptr()  # the pinned buffer itself, no copy
    flat3, view = landing(flat, 8, 25 * 96, allocate)
    assert sizes == [4 * 25 * 96, 8 * 25 * 96] and flat3.numel() == 8 * 25 * 96 and view.is_contiguous()


def test_slots_are_assigned_until_the_pool_is_full_and_come_back(runner):
    streams = [new_stream() for _ in range(4)]
    assert [runner.assign(s) for s in streams] == [True, True, True, False]
    assert sorted(s.slot for s in streams[:3]) == [0, 1, 2] and runner.free_slots == 0
    runner.release(streams[1])
    assert streams[1].slot is None and runner.assign(streams[3]) and runner.free_slots == 0


def stream_through(runner, stream, frames):
    """Decode a stream alone through the runner; returns its audio."""
    runner.assign(stream)
    stream.pending.extend(frames)
    stream.finished = True
    pieces = []
    while stream.ready():
        pieces.append(runner.decode([stream.take_chunk()])[0])
    runner.release(stream)
    return np.concatenate(pieces)


def test_chunked_decode_equals_one_shot_past_the_window(runner, decoder):
    frames = codes(90, 4)  # > 72 frames: the carried attention window slides
    audio = stream_through(runner, new_stream(2, 25), frames)
    assert np.abs(audio - one_shot(decoder, frames)).max() < 1e-4


def test_primed_stream_equals_one_shot_of_reference_and_generated(runner, decoder):
    ref, gen = codes(20, 5), codes(30, 6)
    audio = stream_through(runner, new_stream(4, 25, prime=ref), gen)
    assert audio.shape == (30 * SPF,)
    assert np.abs(audio - one_shot(decoder, np.concatenate([ref, gen]))[20 * SPF:]).max() < 1e-4


def count_primed_rows(runner, monkeypatch) -> list[int]:
    """A list that each priming pass appends its number of references to (its rows less the padding)."""
    primed = []
    prime = runner.pool.prime_padded
    monkeypatch.setattr(runner.pool, "prime_padded", lambda codes, slots, lengths: (
        primed.append(int((lengths > 0).sum())), prime(codes, slots, lengths)))
    return primed


def test_a_reference_is_primed_once_and_its_state_reused_in_other_slots(runner, decoder, monkeypatch):
    """The state priming leaves is kept per reference: a second stream with the same reference (another slot,
    other frames) restores it instead of priming again, and still equals the one-shot decode; a different
    reference primes anew."""
    primed = count_primed_rows(runner, monkeypatch)
    ref, other = codes(20, 5), codes(12, 11)
    runner.assign(new_stream())  # slot 0 busy
    first = stream_through(runner, new_stream(4, 25, prime=ref), codes(9, 6))
    runner.assign(new_stream())  # and the first one's slot too
    gen = codes(30, 12)
    again = stream_through(runner, new_stream(2, 25, prime=ref), gen)
    assert primed == [1]  # the second stream restored the saved state
    assert first.shape == (9 * SPF,)
    assert np.abs(again - one_shot(decoder, np.concatenate([ref, gen]))[20 * SPF:]).max() < 1e-4
    stream_through(runner, new_stream(4, 25, prime=other), gen)
    assert primed == [1, 1]


def test_a_call_primes_each_new_reference_once(runner, decoder, monkeypatch):
    """Two first chunks of one new reference and one of another, in one call: two rows primed, and every
    stream still equals the one-shot decode of its reference and frames."""
    primed = count_primed_rows(runner, monkeypatch)
    ref, other = codes(20, 5), codes(12, 11)
    refs = [ref, other, ref]
    streams = [new_stream(4, 25, prime=r) for r in refs]
    gens = [codes(4, 20 + i) for i in range(len(streams))]
    for s, g in zip(streams, gens):
        s.pending.extend(g)
        s.finished = True
        runner.assign(s)
    audio = runner.decode([s.take_chunk() for s in streams])
    assert primed == [2]
    for r, g, wav in zip(refs, gens, audio):
        assert np.abs(wav - one_shot(decoder, np.concatenate([r, g]))[len(r) * SPF:]).max() < 1e-4


def test_batched_streams_at_different_positions_equal_one_shot(runner, decoder):
    """Three streams fed and decoded together in shared steps: different slots, chunk sizes, starts and a
    primed first chunk in the same call."""
    data = [codes(31, 7), codes(12, 8), codes(20, 9)]
    streams = [new_stream(2, 5), new_stream(3, 4, prime=codes(6, 10)), new_stream(4, 25)]
    audio = [[] for _ in streams]
    fed = [0, 0, 0]
    starts = [0, 2, 4]  # step at which each stream's frames begin to arrive
    for step in range(40):
        for i, (s, d) in enumerate(zip(streams, data)):
            if step >= starts[i] and fed[i] < len(d):
                s.pending.extend(d[fed[i]:fed[i] + 3])
                fed[i] = min(fed[i] + 3, len(d))
                s.finished = fed[i] == len(d)
            if s.due():
                runner.assign(s)
        ready = [i for i, s in enumerate(streams) if s.ready()]
        if ready:
            for i, wav in zip(ready, runner.decode([streams[i].take_chunk() for i in ready])):
                audio[i].append(wav)
    assert all(s.done for s in streams)
    for i, (s, d) in enumerate(zip(streams, data)):
        whole = np.concatenate([s.prime_codes, d])
        expected = one_shot(decoder, whole)[len(s.prime_codes) * SPF:]
        assert np.abs(np.concatenate(audio[i]) - expected).max() < 1e-4, i


def test_a_reused_slot_starts_afresh(runner, decoder):
    stream_through(runner, new_stream(), codes(9, 11))
    frames = codes(9, 12)
    assert np.abs(stream_through(runner, new_stream(2, 3), frames) - one_shot(decoder, frames)).max() < 1e-4


PRIMED = CodecChunk(0, codes(2, 0), True, prime=codes(4, 9))


@pytest.mark.parametrize("chunks, message", [
    ([PRIMED, CodecChunk(0, codes(2, 1), True)], "slots must be distinct"),
    ([CodecChunk(3, codes(2, 0), True)], r"slots must be distinct and in \[0, 3\)"),
    ([PRIMED, CodecChunk(1, codes(0, 1), False)], "at least one frame"),
    ([PRIMED, CodecChunk(1, codes(2, 1)[:, :15], False)], r"\(batch, frames, 16\)"),
    ([PRIMED, CodecChunk(1, codes(2, 1).astype(np.float32), False)], "integers"),
    # one pass checks every chunk's codes: the bad code sits in the last chunk, below or above the codebook
    ([PRIMED, CodecChunk(1, np.full((3, Q), -1), False)], r"must lie in \[0, 2048\)"),
    ([PRIMED, CodecChunk(2, np.full((1, Q), 2048), False)], r"must lie in \[0, 2048\)"),
])
def test_a_call_with_a_bad_chunk_is_refused_before_any_slot_changes(runner, chunks, message):
    """Checked before the first chunk's priming would write slot 0."""
    before = [t.clone() for t in runner.pool.snapshot(0)]
    with pytest.raises(ValueError, match=message):
        runner.decode(chunks)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.pool.snapshot(0)))
