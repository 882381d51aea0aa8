"""The streaming client and decoder against real servers on loopback sockets: every answer form and
framing, keep-alive reuse, https, every failure kind, and arrivals stamped by the kernel."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import io
import ipaddress
import json
import socket
import ssl
import threading
import time
from time import perf_counter

import pytest
import soundfile

from tests.scripted_server import running
from ttsbench import decode, metrics, transport
from ttsbench.client import SpeechClient, combine_clocks

RATE_BYTES = 48000  # 24 kHz, 16-bit mono

SCRIPT = {
    "pcm": {"form": "pcm", "chunks": [[40, 4800], [60, 9600], [80, 2400]]},
    "wav": {"form": "wav", "chunks": [[40, 4800], [60, 4800]]},
    "sse": {"form": "sse", "chunks": [[40, 4800], [60, 4800]]},
    "pcm_length": {"form": "pcm", "framing": "length", "chunks": [[40, 4800], [60, 9600]]},
    "wav_length": {"form": "wav", "framing": "length", "chunks": [[40, 4800], [60, 4800]]},
    "flac": {"form": "flac", "chunks": [[40, 48000]]},
    "pcm22k": {"form": "pcm", "content_type": "audio/pcm; rate=22050", "chunks": [[10, 4410]]},
    "http500": {"status": 500},
    "reset": {"chunks": [[10, 4800], [20, 4800]], "after": "reset"},
    "reset_length": {"framing": "length", "chunks": [[10, 4800], [20, 4800]], "after": "reset"},
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


def _body(text: str) -> bytes:
    return json.dumps({"input": text}).encode()


def _ask(url: str, text: str, timeout: float = 1.0, api_key: str | None = None,
         ssl_context: ssl.SSLContext | None = None):
    async def go():
        async with SpeechClient(url, api_key=api_key, timeout=timeout, ssl_context=ssl_context) as client:
            return await client.speech(_body(text))
    raw = asyncio.run(go())
    dec = decode.decode(raw)
    return raw, dec, metrics.request_figures(raw, dec)


def _check_stream(raw, dec, fig, entry, form: str) -> None:
    assert fig["ok"] and fig["error"] is None and fig["http_status"] == 200
    assert raw.clock == ("kernel" if transport._SO_TIMESTAMPNS is not None else "loop")
    written = sum(w[1] for w in entry["writes"])
    assert fig["bytes"] == written and fig["audio_s"] == written / RATE_BYTES
    assert fig["sample_rate"] == 24000 and sum(n for _, n in fig["chunks"]) == written
    if form == "sse":  # one chunk per event, even when several arrive in one read
        assert [n for _, n in fig["chunks"]] == [w[1] for w in entry["writes"]]
    else:  # a busy machine may deliver two writes in one read
        assert 1 <= fig["n_chunks"] <= len(entry["writes"])
    # first audio is the first audio write, not the WAV header (written at once) or SSE framing,
    # and no arrival precedes the server's write of it
    assert fig["ttfab_ms"] >= (entry["writes"][0][0] - raw.t_start) * 1000
    assert fig["e2e_ms"] >= (entry["t_eof"] - raw.t_start) * 1000
    assert fig["ttfab_ms"] >= 40 and fig["t_headers_ms"] <= fig["ttfab_ms"]
    assert fig["e2e_ms"] >= fig["chunks"][-1][0] and fig["rtf"] == pytest.approx(fig["e2e_ms"] / 1000 / fig["audio_s"], rel=1e-4)
    # the saved WAV holds exactly the samples received
    samples, rate = soundfile.read(io.BytesIO(dec.wav_bytes()), dtype="int16")
    assert rate == 24000 and len(samples) == written // 2


@pytest.mark.parametrize("text", ["pcm", "wav", "sse", "pcm_length", "wav_length"])
def test_streams_are_read_with_audio_arrivals(server, text):
    raw, dec, fig = _ask(server.url, text, api_key="k-123")
    entry = server.entries([text])[text]
    _check_stream(raw, dec, fig, entry, SCRIPT[text]["form"])
    assert entry["authorization"] == "Bearer k-123"
    if text.endswith("_length"):
        assert "transfer-encoding" not in raw.headers
        assert int(raw.headers["content-length"]) == sum(len(d) for _, d in raw.chunks)
    else:
        assert raw.headers["transfer-encoding"] == "chunked"


def test_flac_whole_response_is_decoded(server):
    _, dec, fig = _ask(server.url, "flac")
    assert fig["ok"] and fig["audio_s"] == pytest.approx(1.0) and fig["sample_rate"] == 24000
    samples, _ = soundfile.read(io.BytesIO(dec.wav_bytes()), dtype="int16")
    assert len(samples) == 24000


def test_pcm_rate_from_content_type(server):
    _, _, fig = _ask(server.url, "pcm22k")
    assert fig["ok"] and fig["sample_rate"] == 22050 and fig["audio_s"] == pytest.approx(0.1)


def test_keep_alive_reuses_connections_and_grows_with_the_load(server):
    """One connection for requests one after another; as many as requests in flight, then reused."""
    texts = [f"keep {i}" for i in range(11)]

    async def go():
        async with SpeechClient(server.url, timeout=5) as client:
            for text in texts[:3]:
                assert (await client.speech(_body(text))).error is None
            for batch in (texts[3:7], texts[7:11]):
                raws = await asyncio.gather(*(client.speech(_body(t)) for t in batch))
                assert all(r.error is None for r in raws)

    asyncio.run(go())
    ports = {t: e["peer_port"] for t, e in server.entries(texts).items()}
    one_by_one = {ports[t] for t in texts[:3]}
    first_burst, second_burst = {ports[t] for t in texts[3:7]}, {ports[t] for t in texts[7:11]}
    assert len(one_by_one) == 1
    assert len(first_burst) == 4 and one_by_one <= first_burst
    assert second_burst == first_burst


@pytest.mark.parametrize("text,kind,detail", [
    ("http500", "http_500", "scripted failure 500"),
    ("reset", "reset", "before the response was complete (peer closed connection"),
    ("reset_length", "reset", "received 9600 bytes, expected"),
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


def test_a_failure_leaves_the_pool_usable(server):
    """A reset or timed-out connection is dropped, not handed to the next request."""
    async def go():
        async with SpeechClient(server.url, timeout=1) as client:
            return [await client.speech(_body(t)) for t in ("reset", "keep after 0", "hang", "keep after 1")]
    reset, ok1, hang, ok2 = asyncio.run(go())
    assert reset.error == "reset" and hang.error == "timeout"
    assert ok1.error is None and ok2.error is None and ok1.status == ok2.status == 200


def test_connect_refused_is_classified():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before use: nothing listens there
    raw, _, fig = _ask(f"http://127.0.0.1:{port}", "pcm")
    assert fig["error"] == "connect" and "ConnectionRefusedError" in fig["error_detail"]
    assert fig["http_status"] is None and fig["n_chunks"] == 0 and raw.clock is None


# https: a loopback TLS server with a self-signed certificate made here

@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    root = tmp_path_factory.mktemp("tls")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ttsbench test")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = root / "cert.pem", root / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    with running(SCRIPT, root / "server", tls=(cert_path, key_path)) as srv:
        yield srv, ssl.create_default_context(cafile=str(cert_path))


@pytest.mark.parametrize("text", ["pcm", "sse", "pcm_length"])
def test_https_streams(tls_server, text):
    srv, trust = tls_server
    assert srv.url.startswith("https://")
    raw, dec, fig = _ask(srv.url, text, ssl_context=trust)
    _check_stream(raw, dec, fig, srv.entries([text])[text], SCRIPT[text]["form"])


def test_https_keep_alive_and_control_plane(tls_server):
    srv, trust = tls_server
    texts = ["tls keep 0", "tls keep 1"]

    async def go():
        async with SpeechClient(srv.url, timeout=5, ssl_context=trust) as client:
            models = await client.get_json("/v1/models")
            raws = [await client.speech(_body(t)) for t in texts]
            return models, raws
    models, raws = asyncio.run(go())
    assert models["status"] == 200 and models["body"]["data"][0]["id"] == "scripted-tts"
    assert all(r.error is None for r in raws)
    assert len({e["peer_port"] for e in srv.entries(texts).values()}) == 1


def test_https_untrusted_certificate_is_a_connect_failure(tls_server):
    srv, _ = tls_server
    _, _, fig = _ask(srv.url, "pcm")  # the system's trust store does not know the test's certificate
    assert fig["error"] == "connect" and "certificate verify failed" in fig["error_detail"]


# Servers that act on cue, in a thread of the test process

@contextlib.contextmanager
def cue_server(answer):
    """A loopback HTTP server for one connection: it reads the request, then `answer(conn)` writes."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = listener.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, body = data.split(b"\r\n\r\n", 1)
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            while len(body) < length:
                body += conn.recv(65536)
            answer(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()
        thread.join(5)


@pytest.mark.parametrize("clock", ["kernel", "loop"])
def test_arrival_is_the_kernels_receive_time_not_the_loops(monkeypatch, clock):
    """The event loop is blocked while a chunk arrives; its stamp must still be the arrival time.
    With kernel stamps switched off (as where the platform has none), it is the loop's late read."""
    if clock == "loop":
        monkeypatch.setattr(transport, "_SO_TIMESTAMPNS", None)
        monkeypatch.setattr(transport, "_ANC", 0)
    elif transport._SO_TIMESTAMPNS is None:
        pytest.skip("no kernel receive stamps on this platform")
    headers_sent, go, sent_event, sent = threading.Event(), threading.Event(), threading.Event(), {}

    def answer(conn):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: audio/pcm\r\nTransfer-Encoding: chunked\r\n\r\n")
        headers_sent.set()
        go.wait(10)
        sent["before"] = perf_counter()
        conn.sendall(b"12c0\r\n" + bytes(4800) + b"\r\n0\r\n\r\n")
        sent["after"] = perf_counter()
        sent_event.set()

    async def scenario(url):
        async with SpeechClient(url, timeout=10) as client:
            task = asyncio.ensure_future(client.speech(b"{}"))
            while not headers_sent.is_set():  # the request is out and answered
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.01)  # the loop reads the headers
            go.set()
            sent_event.wait(10)   # the loop is blocked while the chunk arrives ...
            time.sleep(0.05)      # ... and for 50 ms more
            resumed = perf_counter()
            return await task, resumed

    with cue_server(answer) as url:
        raw, resumed = asyncio.run(scenario(url))
    assert raw.error is None and raw.clock == clock
    (t_chunk, data), = raw.chunks
    assert len(data) == 4800 and raw.t_end == t_chunk
    if clock == "kernel":  # stamped as the chunk arrived, well before the loop could read it (50 ms later); on a
        # loaded machine the kernel's stamp may trail the sender's return by a few ms, never by the loop's delay
        assert sent["before"] - 0.001 <= t_chunk < resumed - 0.025, (sent, t_chunk, resumed)
    else:
        assert t_chunk >= resumed


def test_a_runs_clock_names_every_stamp():
    assert combine_clocks([None, "kernel", "kernel"]) == "kernel"
    assert combine_clocks(["loop", "kernel"]) == "mixed"
    assert combine_clocks([None]) is None


def test_malformed_response_is_other():
    with cue_server(lambda conn: conn.sendall(b"not http\r\n\r\n")) as url:
        raw, _, fig = _ask(url, "x")
    assert fig["error"] == "other" and "malformed HTTP response" in fig["error_detail"]


def test_connection_closed_before_answering_is_reset():
    with cue_server(lambda conn: None) as url:
        _, _, fig = _ask(url, "x")
    assert fig["error"] == "reset" and "before answering" in fig["error_detail"]


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
