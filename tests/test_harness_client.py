"""The streaming client and decoder against a real server: every answer form and every failure kind."""

from __future__ import annotations

import asyncio
import io
import json
import socket

import pytest
import soundfile

from tests.scripted_server import running
from ttsbench import decode, metrics
from ttsbench.client import SpeechClient

RATE_BYTES = 48000  # 24 kHz, 16-bit mono

SCRIPT = {
    "pcm": {"form": "pcm", "chunks": [[40, 4800], [60, 9600], [80, 2400]]},
    "wav": {"form": "wav", "chunks": [[40, 4800], [60, 4800]]},
    "sse": {"form": "sse", "chunks": [[40, 4800], [60, 4800]]},
    "flac": {"form": "flac", "chunks": [[40, 48000]]},
    "pcm22k": {"form": "pcm", "content_type": "audio/pcm; rate=22050", "chunks": [[10, 4410]]},
    "http500": {"status": 500},
    "reset": {"chunks": [[10, 4800], [20, 4800]], "after": "reset"},
    "hang": {"chunks": [[10, 4800]], "after": "hang"},
    "json200": {"form": "json"},
    "sse_no_done": {"form": "sse", "chunks": [[10, 4800]], "sse_done": False},
    "wav_short": {"form": "wav", "chunks": [[10, 4800]], "wav_data_size": 9600},
    "half_sample": {"chunks": [[10, 4801]]},
    "empty": {"chunks": []},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running(SCRIPT, tmp_path_factory.mktemp("client")) as srv:
        yield srv


def _ask(url: str, text: str, timeout: float = 1.0, api_key: str | None = None):
    async def go():
        async with SpeechClient(url, api_key=api_key, timeout=timeout) as client:
            return await client.speech(json.dumps({"input": text}).encode())
    raw = asyncio.run(go())
    dec = decode.decode(raw)
    return raw, dec, metrics.request_figures(raw, dec)


@pytest.mark.parametrize("form", ["pcm", "wav", "sse"])
def test_streams_are_read_with_audio_arrivals(server, form):
    raw, dec, fig = _ask(server.url, form, api_key="k-123")
    entry = server.entries([form])[form]
    assert fig["ok"] and fig["error"] is None and fig["http_status"] == 200
    written = sum(n for _, n in entry["writes"])
    assert fig["bytes"] == written and fig["audio_s"] == written / RATE_BYTES
    assert fig["sample_rate"] == 24000 and sum(n for _, n in fig["chunks"]) == written
    if form == "sse":  # one chunk per event, even when several arrive in one read
        assert [n for _, n in fig["chunks"]] == [n for _, n in entry["writes"]]
    else:  # a busy machine may deliver two writes in one read
        assert 1 <= fig["n_chunks"] <= len(entry["writes"])
    # first audio is the first audio write, not the WAV header (written at once) or SSE framing
    assert fig["ttfab_ms"] >= (entry["writes"][0][0] - raw.t_start) * 1000
    assert fig["ttfab_ms"] >= 40 and fig["t_headers_ms"] <= fig["ttfab_ms"]
    assert fig["e2e_ms"] >= fig["chunks"][-1][0] and fig["rtf"] == pytest.approx(fig["e2e_ms"] / 1000 / fig["audio_s"], rel=1e-4)
    assert entry["authorization"] == "Bearer k-123"
    # the saved WAV holds exactly the samples received
    samples, rate = soundfile.read(io.BytesIO(dec.wav_bytes()), dtype="int16")
    assert rate == 24000 and len(samples) == written // 2


def test_flac_whole_response_is_decoded(server):
    _, dec, fig = _ask(server.url, "flac")
    assert fig["ok"] and fig["audio_s"] == pytest.approx(1.0) and fig["sample_rate"] == 24000
    samples, _ = soundfile.read(io.BytesIO(dec.wav_bytes()), dtype="int16")
    assert len(samples) == 24000


def test_pcm_rate_from_content_type(server):
    _, _, fig = _ask(server.url, "pcm22k")
    assert fig["ok"] and fig["sample_rate"] == 22050 and fig["audio_s"] == pytest.approx(0.1)


@pytest.mark.parametrize("text,kind,detail", [
    ("http500", "http_500", "scripted failure 500"),
    ("reset", "reset", "before the response was complete"),
    ("hang", "timeout", "within 1 s"),
    ("json200", "invalid_audio", "application/json"),
    ("sse_no_done", "truncated", "speech.audio.done"),
    ("wav_short", "truncated", "9600"),
    ("half_sample", "truncated", "inside a sample"),
    ("empty", "invalid_audio", "no audio"),
])
def test_failures_are_classified(server, text, kind, detail):
    _, _, fig = _ask(server.url, text)
    assert not fig["ok"] and fig["error"] == kind and detail in fig["error_detail"]
    assert fig["rtf"] is None and fig["e2e_ms"] is not None


def test_partial_stream_keeps_what_arrived(server):
    _, _, fig = _ask(server.url, "reset")
    assert fig["bytes"] == 9600 and fig["ttfab_ms"] is not None


def test_connect_refused_is_classified():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before use: nothing listens there
    _, _, fig = _ask(f"http://127.0.0.1:{port}", "pcm")
    assert fig["error"] == "connect" and fig["http_status"] is None and fig["n_chunks"] == 0


def _raw(headers: dict, pieces: list[tuple[float, bytes]]):
    from ttsbench.client import RawResponse
    return RawResponse(t_start=0.0, status=200, headers=headers, t_headers=0.0, chunks=pieces, t_end=pieces[-1][0])


def test_sse_deltas_that_each_carry_a_wav_file():
    import base64
    from tests.scripted_server import _pcm, _wav_header

    def event(data: bytes) -> bytes:
        return b"data: " + json.dumps({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}).encode() + b"\n\n"

    pieces = [(0.1, event(_wav_header(24000, 4800) + _pcm(4800, 0))),
              (0.2, event(_wav_header(24000, 2400) + _pcm(2400, 1))),
              (0.3, b'data: {"type": "speech.audio.done"}\n\n')]
    dec = decode.decode(_raw({"content-type": "text/event-stream"}, pieces))
    assert dec.error is None and dec.n_bytes == 7200 and [c[:2] for c in dec.chunks] == [(0.1, 4800), (0.2, 2400)]


def test_wav_header_split_over_reads_and_zero_sizes():
    from tests.scripted_server import _pcm, _wav_header
    header = _wav_header(16000, 0)  # some servers write 0 for "unknown"
    pieces = [(0.1, header[:20]), (0.2, header[20:] + _pcm(320, 0)), (0.3, _pcm(640, 1))]
    dec = decode.decode(_raw({"content-type": "audio/wav"}, pieces))
    assert dec.error is None and dec.sample_rate == 16000 and dec.audio_s == pytest.approx(960 / 32000)
    assert [c[:2] for c in dec.chunks] == [(0.2, 320), (0.3, 640)]


def test_sse_with_crlf_framing_split_across_reads():
    import base64
    from tests.scripted_server import _pcm
    event = (b"event: speech.audio.delta\r\ndata: " +
             json.dumps({"type": "speech.audio.delta", "audio": base64.b64encode(_pcm(960, 0)).decode()}).encode() +
             b"\r\n\r\n" + b'data: {"type": "speech.audio.done"}\r\n\r\n')
    cut = event.index(b"\r\n\r\n") + 1  # between the \r and the \n that end the first event
    dec = decode.decode(_raw({"content-type": "text/event-stream; charset=utf-8"}, [(0.1, event[:cut]), (0.2, event[cut:])]))
    assert dec.error is None and dec.n_bytes == 960 and [c[:2] for c in dec.chunks] == [(0.2, 960)]
