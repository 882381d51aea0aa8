"""Stage 1 with the real (tiny, random) codec decoder: chunk plans and batched decoding."""

import numpy as np
import pytest
import torch

from serving.engine.codec_stage import CodecRunner, CodecStream
from serving.model.codec_config import tiny_codec_config
from serving.model.codec_decoder import CodecDecoder, init_random_

Q = 16


@pytest.fixture(scope="module")
def runner():
    torch.manual_seed(0)
    decoder = CodecDecoder(tiny_codec_config().decoder)
    init_random_(decoder, torch.Generator().manual_seed(0))
    return CodecRunner(decoder.eval(), torch.device("cpu"), Q)


def codes(n, seed):
    return np.random.default_rng(seed).integers(0, 2048, size=(n, Q), dtype=np.int64)


def drain(stream, frames, feed_sizes):
    """Feed `frames` in bursts of the given sizes, taking chunks whenever ready: returns chunk (context, new) lengths."""
    out, i = [], 0
    for size in feed_sizes:
        stream.pending.extend(frames[i:i + size])
        i += size
        if i >= len(frames):
            stream.finished = True
        while stream.ready():
            ctx, new = stream.take_chunk()
            out.append((len(ctx), len(new)))
    assert stream.done
    return out


def test_chunk_boundaries_depend_on_frame_indices_not_arrival():
    frames = list(codes(60, 1))
    plans = []
    for feed in ([1] * 60, [7] * 9, [60], [3, 50, 7]):
        plans.append(drain(CodecStream(4, 25, 30, np.zeros((0, Q), np.int64)), frames, feed))
    assert all(p == plans[0] for p in plans)
    assert plans[0] == [(0, 4), (4, 25), (29, 25), (30, 6)]


def test_reference_codes_are_the_first_chunks_context():
    ref = codes(100, 2)
    stream = CodecStream(3, 25, 72, ref)
    stream.pending.extend(codes(3, 3))
    ctx, new = stream.take_chunk()
    assert np.array_equal(ctx, ref[-72:]) and len(new) == 3


def test_chunked_decode_with_full_context_equals_one_shot(runner):
    frames = codes(12, 4)
    whole = runner.decode([(frames[:0], frames)])[0]
    stream = CodecStream(2, 4, 100, frames[:0])
    stream.pending.extend(frames)
    stream.finished = True
    pieces = []
    while stream.ready():
        pieces.append(runner.decode([stream.take_chunk()])[0])
    assert len(pieces) == 4
    assert np.abs(np.concatenate(pieces) - whole).max() < 1e-4


def test_batched_rows_of_different_context_and_length_equal_single_rows(runner):
    chunks = [(codes(0, 5), codes(2, 6)), (codes(9, 7), codes(5, 8)), (codes(4, 9), codes(3, 10))]
    batched = runner.decode(chunks)
    for chunk, got in zip(chunks, batched):
        alone = runner.decode([chunk])[0]
        assert got.shape == (len(chunk[1]) * 1920,) and np.abs(got - alone).max() < 1e-4
