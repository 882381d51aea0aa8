"""A request that fails after its audio has started must never look like a short but complete answer."""

import http.client
import json

import pytest

from tests.server_fixtures import ServerThread, logged, post_json

BODY = {"input": "Hello there, this is a longer sentence.", "voice": "vivian", "stream": True,
        "max_new_tokens": 40, "seed": 1}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    server = ServerThread("tiny-random", tmp_path_factory.mktemp("voices"),
                          request_log=tmp_path_factory.mktemp("log") / "requests.jsonl")
    yield server
    server.stop()


@pytest.fixture
def codec_fails_after_first_chunk(srv, monkeypatch):
    """The engine's codec stage raises on its second call: the first chunk is out, the rest never comes."""
    codec = srv.server.engine.codec
    real, calls = codec.decode, []

    def decode(chunks):
        calls.append(len(chunks))
        if len(calls) > 1:
            raise RuntimeError("injected codec failure")
        return real(chunks)

    monkeypatch.setattr(codec, "decode", decode)
    return calls


def _post(srv, body) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    conn.request("POST", "/v1/audio/speech", json.dumps(body), {"Content-Type": "application/json"})
    return conn.getresponse()


def test_raw_pcm_stream_breaks_off_without_its_final_chunk(srv, codec_fails_after_first_chunk):
    resp = _post(srv, {**BODY, "response_format": "pcm"})
    assert resp.status == 200
    with pytest.raises(http.client.IncompleteRead) as info:
        resp.read()
    assert len(info.value.partial) == 2 * 1920 * 2  # the first chunk (2 frames of s16le) arrived, then the break
    assert len(codec_fails_after_first_chunk) >= 2
    line = logged(srv, resp.getheader("X-Request-Id"))  # the request log says so too
    assert line["outcome"] == "failed" and "first_sent" in line["ms"] and line["ms"]["end"] >= line["ms"]["first_sent"]


def test_sse_stream_ends_with_an_error_event_and_no_done(srv, codec_fails_after_first_chunk):
    resp = _post(srv, {**BODY, "response_format": "pcm", "stream_format": "sse"})
    assert resp.status == 200
    events = [json.loads(line[len("data: "):]) for line in resp.read().decode().splitlines()
              if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "speech.audio.delta" and kinds[-1] == "error"
    assert "speech.audio.done" not in kinds
    assert events[-1]["error"]["code"] == "generation_failed"


def test_the_server_keeps_serving_after_a_mid_stream_failure(srv):
    status, _headers, body = post_json(srv.url + "/v1/audio/speech", {**BODY, "stream": False,
                                                                        "response_format": "pcm"})
    assert status == 200 and len(body) == 40 * 1920 * 2  # the server generates max_new_tokens frames
