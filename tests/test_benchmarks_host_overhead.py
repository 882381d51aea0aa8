"""benchmarks/host_overhead.py drives the real Engine through its stage stubs: they keep to the interface the
engine uses (a drift fails here, not in a recorded run), every request's audio arrives, and its emulated
decode steps follow one another as a GPU's do."""

import asyncio

import pytest

from benchmarks.host_overhead import StubCodec, StubTalker, run_level
from serving.engine.codec_stage import CodecChunk
from serving.model.codec_stream import chunk_plan


def test_every_request_gets_all_its_audio_through_the_stubbed_engine():
    row = asyncio.run(run_level(concurrency=4, requests=10, frames=30, step_ms=0, codec_ms=0))
    assert row["audio_s"] == 10 * 30 / 12.5  # every frame of every request, as samples
    assert row["steps"] >= 30 * 10 / 4 and 1 <= row["rows_per_step"] <= 4
    assert row["codec_chunks"] == 10 * len(chunk_plan(30, 2, 25))  # the engine's default chunking
    assert 1 <= row["rows_per_codec_call"] <= 4
    assert row["deliver_ms_p50"] is not None and "of_ideal" not in row


def test_an_emulated_step_starts_when_the_one_before_it_is_done():
    talker = StubTalker(num_slots=2, step_s=10.0, frames=5)  # long steps: no clock reading can overtake them
    first, second = talker.launch(2), talker.launch(2)
    assert second.ready_at - first.ready_at == pytest.approx(10.0)
    row = asyncio.run(run_level(concurrency=2, requests=2, frames=20, step_ms=2, codec_ms=1))
    assert row["audio_s"] == 2 * 20 / 12.5 and 0 < row["of_ideal"] <= 1


def test_the_stub_codec_counts_the_padding_a_gpu_call_would_compute():
    """As CodecRunner with graphs: the cheapest covering (rows, frames) shape, or the call's own beyond them."""
    import numpy as np

    codec = StubCodec(num_slots=8, call_s=0, buckets=[(1, 25), (4, 2), (4, 25), (8, 25)])
    chunk = lambda frames: CodecChunk(0, np.zeros((frames, 16), dtype=np.int64), True)  # noqa: E731
    codec.decode([chunk(25), chunk(2), chunk(4)])  # (4, 25): one row only fills the batch
    assert (codec.frames_decoded, codec.frames_computed, codec.frames_padding_rows) == (31, 100, 25)
    codec.decode([chunk(2)] * 3)  # (4, 2)
    codec.decode([chunk(30)])  # its own shape
    assert (codec.frames_decoded, codec.frames_computed, codec.frames_padding_rows) == (67, 138, 27)
    row = asyncio.run(run_level(concurrency=4, requests=8, frames=30, step_ms=0, codec_ms=0))
    # every frame decoded once; the shapes' padding on top, and the share follows from the two
    assert row["codec_frames_decoded"] == 8 * 30 and row["codec_frames_computed"] >= 8 * 30
    assert row["codec_padded_share"] == round(1 - 8 * 30 / row["codec_frames_computed"], 3)
    assert 0 <= row["codec_rows_share"] <= row["codec_padded_share"]
    assert abs(row["codec_lengths_share"] - (row["codec_padded_share"] - row["codec_rows_share"])) <= 0.0011
