"""The reference server end to end on a real socket, CustomVoice tiny random checkpoint."""

import base64
import concurrent.futures as cf
import gc
import http.client
import io
import json
import struct
import time
import urllib.request

import numpy as np
import pytest
import soundfile as sf

from tests.server_fixtures import ServerThread, logged, post_json
from benchmarks import engine_phases
from benchmarks.request_timeline import STEPS, split_waves, summarise
from serving.engine.engine import PHASES, TIMELINE

pytestmark = pytest.mark.slow
FRAMES = 6  # max_new_tokens of most requests: random weights never end speech, so this is the length


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    gc.unfreeze()  # servers of earlier test modules froze theirs: the check below is this server's
    srv = ServerThread("tiny-random", tmp_path_factory.mktemp("voices"), max_batch_size=8, max_queue=4,
                       max_codec_batch=4, request_log=tmp_path_factory.mktemp("log") / "requests.jsonl")
    yield srv
    srv.stop()


def speech(server, timeout=120, **fields):
    body = {"input": "Hello world.", "voice": "vivian", "max_new_tokens": FRAMES, "seed": 7, **fields}
    return post_json(server.url + "/v1/audio/speech", body, timeout=timeout)


def pcm_of(status_headers_body):
    status, headers, body = status_headers_body
    assert status == 200, body[:300]
    return np.frombuffer(body, "<i2")


def test_health_models_and_metrics(server):
    with urllib.request.urlopen(server.url + "/health") as r:
        health = json.loads(r.read())
    assert health["status"] == "ok" and health["engine"]["num_slots"] == 8 and health["engine"]["max_codec_batch"] == 4
    assert health["engine"]["codec_table_bytes"] > 0  # the codebooks' projected vectors (the codec's table)
    startup, warmup = health["engine"]["startup_s"], health["engine"]["warmup_s"]  # where start-up went, by phase
    assert set(startup) == {"load", "talker_warmup", "codec_warmup", "total"} and min(startup.values()) >= 0
    assert startup["total"] >= startup["load"] and set(warmup) == {"steps", "frame_graphs", "prefill_graphs",
                                                                       "admission", "voice_encoders"}
    with urllib.request.urlopen(server.url + "/v1/models") as r:
        models = json.loads(r.read())
    assert models["data"][0]["id"] == "tiny-random" and models["data"][0]["task_type"] == "CustomVoice"
    assert "vivian" in models["data"][0]["speakers"]
    m = server.metrics()
    assert m["ttsbench_kv_slots_total"] == 8 and "ttsbench_queue_depth" in m
    assert gc.get_freeze_count() > 10_000  # the loaded, warmed engine's objects are out of the collector's reach


def test_every_format_non_streaming(server):
    pcm = pcm_of(speech(server, response_format="pcm"))
    assert len(pcm) == FRAMES * 1920
    status, headers, wav = speech(server, response_format="wav")
    assert status == 200 and headers["Content-Type"] == "audio/wav" and headers["X-Sample-Rate"] == "24000"
    assert headers["X-Seed"] == "7" and headers["X-Request-Id"]
    assert wav[44:] == pcm.tobytes() and struct.unpack("<I", wav[40:44])[0] == len(pcm) * 2
    for fmt in ("flac", "mp3", "opus"):
        status, headers, body = speech(server, response_format=fmt)
        assert status == 200, body[:200]
        audio, sr = sf.read(io.BytesIO(body), dtype="float32")
        assert sr == 24000 and abs(len(audio) - len(pcm)) < 0.1 * len(pcm)
        if fmt == "flac":
            assert np.array_equal(sf.read(io.BytesIO(body), dtype="int16")[0], pcm)


def test_streamed_chunks_equal_the_whole_response(server):
    whole = pcm_of(speech(server, response_format="pcm"))
    status, headers, body = speech(server, response_format="pcm", stream=True)
    assert status == 200 and headers["Content-Type"] == "audio/pcm"
    assert np.array_equal(np.frombuffer(body, "<i2"), whole)
    status, headers, body = speech(server, response_format="wav", stream=True)
    assert body[:4] == b"RIFF" and struct.unpack("<I", body[40:44])[0] == 0xFFFFFFFF
    assert np.array_equal(np.frombuffer(body[44:], "<i2"), whole)
    status, headers, body = speech(server, response_format="pcm", stream=True, stream_format="sse")
    assert headers["Content-Type"] == "text/event-stream"
    events = [json.loads(line[6:]) for line in body.decode().split("\n\n") if line.startswith("data: ")]
    assert [e["type"] for e in events][-1] == "speech.audio.done" and len(events) >= 3
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert np.array_equal(np.frombuffer(audio, "<i2"), whole)
    # another first chunk size re-chunks the same codes: with every earlier frame as context (6 < 8 frames)
    # the audio is the same up to float rounding in the decoder
    rechunked = pcm_of(speech(server, response_format="pcm", initial_codec_chunk_frames=1))
    assert np.abs(rechunked.astype(int) - whole).max() <= 2


def test_concurrent_seeded_requests_equal_sequential(server):
    variants = [dict(seed=i, temperature=0.5 + 0.1 * i, voice=v, top_k=[0, 10, 50][i % 3],
                     language=["auto", "english", "chinese"][i % 3], do_sample=i != 3)
                for i, v in enumerate(["vivian", "ryan", "dylan", "eric", "aiden", "serena", "sohee", "vivian"])]
    sequential = [pcm_of(speech(server, response_format="pcm", **v)) for v in variants]
    with cf.ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(lambda v: pcm_of(speech(server, response_format="pcm", **v)), variants))
    for a, b in zip(sequential, concurrent):  # same codes; the batched codec may round the last bit apart
        assert np.abs(a.astype(int) - b).max() <= 2
    assert len({a.tobytes() for a in sequential}) == 8  # the parameters really differ per request


def test_speed_changes_duration(server):
    fast = pcm_of(speech(server, response_format="pcm", speed=2.0))
    assert len(fast) == FRAMES * 1920 // 2


@pytest.mark.parametrize("body,status,param", [
    ({"input": ""}, 400, "input"),
    ({"input": "x" * 5000}, 400, "input"),
    ({"input": "hi", "voice": "nobody"}, 400, "voice"),
    ({"input": "hi", "language": "elvish"}, 400, "language"),
    ({"input": "hi", "task_type": "Base"}, 400, "task_type"),
    ({"input": "hi", "model": "other-model"}, 404, "model"),
    ({"input": "hi", "ref_audio": "data:audio/wav;base64,!!"}, 400, "ref_audio"),
    ({"input": "hi", "max_new_tokens": 300}, 400, "input"),
    ({"input": "word " * 400}, 400, "input"),  # tokenizes past --max-model-len 256: refused at prefill
])
def test_errors_then_a_good_request(server, body, status, param):
    got, headers, raw = post_json(server.url + "/v1/audio/speech", body)
    err = json.loads(raw)["error"]
    assert got == status and err["param"] == param and err["message"] and "Traceback" not in raw.decode()
    assert set(err) == {"message", "type", "param", "code"}
    assert len(pcm_of(speech(server, response_format="pcm"))) == FRAMES * 1920


def test_protocol_errors_404_413_and_bad_json(server):
    for path, data, ctype, status in (("/v1/audio/speech", b"{not json", "application/json", 400),
                                      ("/v1/audio/speech", b"", "application/json", 400),
                                      ("/v1/audio/speech", b'{"input": "\xff\xfe"}', "application/json", 400),
                                      ("/v1/nothing", b"{}", "application/json", 404),
                                      ("/v1/audio/speech", b"x" * (17 * 1024 * 1024), "application/json", 413)):
        req = urllib.request.Request(server.url + path, data=data, method="POST", headers={"Content-Type": ctype})
        try:
            urllib.request.urlopen(req, timeout=60)
            raise AssertionError("expected an error")
        except urllib.error.HTTPError as e:
            error = json.loads(e.read())["error"]
            assert e.code == status
            if status == 400:
                assert error["code"] == "invalid_json" and "not valid JSON" in error["message"], (data[:20], error)
        except (ConnectionResetError, BrokenPipeError):
            assert status == 413  # the server may close before the client finishes sending 17 MB
    assert len(pcm_of(speech(server, response_format="pcm"))) == FRAMES * 1920


def test_disconnect_frees_the_slot(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = json.dumps({"input": "A long one.", "voice": "ryan", "max_new_tokens": 200, "stream": True,
                       "response_format": "pcm", "seed": 1})
    conn.request("POST", "/v1/audio/speech", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and len(resp.read1(4096)) > 0
    assert server.metrics()["ttsbench_running"] == 1
    before = server.metrics().get("ttsbench_cancelled_requests_total", 0)
    conn.sock.close()
    conn.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["ttsbench_running"] == 0 and m["ttsbench_kv_slots_free"] == 8:
            break
        time.sleep(0.1)
    assert m["ttsbench_running"] == 0 and m["ttsbench_kv_slots_free"] == 8
    assert m["ttsbench_cancelled_requests_total"] == before + 1
    assert m["ttsbench_frames_generated_total"] < 10_000
    # the counters benchmarks/engine_phases.py reads per load level, under the names it reads them by
    assert m["ttsbench_slot_moves_total"] >= 0
    line = logged(server, resp.getheader("X-Request-Id"))
    assert line["outcome"] == "cancelled" and 0 < line["frames"] < 200 and "last_frame" not in line["ms"]


def test_burst_beyond_the_queue_gets_503_with_retry_after(server):
    def one(i):
        return post_json(server.url + "/v1/audio/speech",
                         {"input": "Burst.", "voice": "vivian", "max_new_tokens": 4, "seed": i,
                          "response_format": "pcm"}, timeout=300)

    with cf.ThreadPoolExecutor(24) as pool:
        results = list(pool.map(one, range(24)))
    statuses = [r[0] for r in results]
    assert set(statuses) <= {200, 503} and statuses.count(200) >= 8 and 503 in statuses
    for status, headers, body in results:
        if status == 503:
            assert int(headers["Retry-After"]) >= 1 and json.loads(body)["error"]["code"] == "server_busy"
    assert len(pcm_of(speech(server, response_format="pcm"))) == FRAMES * 1920
    assert server.metrics()['ttsbench_requests_total{endpoint="/v1/audio/speech",status="503"}'] >= 1


def test_openai_sdk(server, tmp_path):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    resp = client.audio.speech.create(model="tiny-random", voice="vivian", input="Hello from the SDK.",
                                      response_format="wav", extra_body={"max_new_tokens": FRAMES, "seed": 7})
    audio, sr = sf.read(io.BytesIO(resp.content))
    assert sr == 24000 and len(audio) == FRAMES * 1920
    out = tmp_path / "streamed.pcm"
    with client.audio.speech.with_streaming_response.create(
            model="tiny-random", voice="vivian", input="Hello world.", response_format="pcm",
            extra_body={"max_new_tokens": FRAMES, "seed": 7, "stream": True}) as streamed:
        streamed.stream_to_file(out)
    assert out.read_bytes() == pcm_of(speech(server, response_format="pcm")).tobytes()
    with pytest.raises(openai.BadRequestError):
        client.audio.speech.create(model="tiny-random", voice="alloy", input="x")


def test_metrics_break_requests_down_by_engine_phase(server):
    """ttsbench_engine_phase_seconds says where the time went (serving.engine.engine.PHASES): after one more
    streamed request every phase gained observations, per request, per pass, per step or per chunk."""
    def counts():
        m = server.metrics()
        return {phase: m.get(f'ttsbench_engine_phase_seconds_count{{phase="{phase}"}}', 0.0) for phase in PHASES}

    def scrape():
        with urllib.request.urlopen(server.url + "/metrics", timeout=10) as resp:
            return resp.read().decode()

    before, text_before = counts(), scrape()
    status, _, body = speech(server, response_format="pcm", stream=True)
    assert status == 200 and len(body) == FRAMES * 1920 * 2
    after, text_after = counts(), scrape()
    # benchmarks/engine_phases.py reads the same scrapes: the request's frames all decoded, and on a CPU (no
    # graphs) a call computes its rows x its longest chunk, so the padding is what mixed chunk lengths leave
    codec = engine_phases.diff(text_before, text_after)["codec_frames"]
    assert codec["decoded"] == FRAMES and codec["computed"] >= codec["decoded"]
    assert codec["padded_share"] == round(1 - codec["decoded"] / codec["computed"], 3)
    assert codec["rows_share"] == 0 and codec["lengths_share"] == codec["padded_share"]
    gained = {phase: after[phase] - before[phase] for phase in PHASES}
    assert gained["queue"] == 1 and gained["first_frames"] == 1 and gained["prefill"] >= 1
    assert gained["talker_step"] >= FRAMES  # one step per frame (other requests' steps would only add)
    assert gained["codec_call"] >= 2 and gained["codec_wait"] >= gained["codec_call"]  # the stream's chunks
    assert gained["accept"] == 1 and gained["deliver"] == gained["codec_wait"]  # each chunk reached the handler
    assert gained["voice"] == 0  # a voice clone's new reference voice only (tests/test_engine_voices.py)
    m = server.metrics()
    assert all(m[f'ttsbench_engine_phase_seconds_sum{{phase="{phase}"}}'] > 0 for phase in PHASES if phase != "voice")


def test_request_log_gives_each_request_its_timeline(server):
    """--request-log: one line per request with its milestones (TIMELINE) in ms since arrival, in the order a
    request meets them, and the batch sizes it met; benchmarks/request_timeline.py summarises such lines."""
    text = "A timeline, please."
    status, headers, body = speech(server, input=text, response_format="pcm", stream=True)
    assert status == 200
    line = logged(server, headers["X-Request-Id"])
    assert line["chars"] == len(text) and line["outcome"] == "ok" and line["frames"] == FRAMES
    ms = line["ms"]
    assert set(ms) == set(TIMELINE)
    first_audio = [name for name in TIMELINE if not name.startswith("last_") and name != "end"]
    assert [ms[name] for name in first_audio] == sorted(ms[name] for name in first_audio)
    end = ["first_due", "last_frame", "last_codec_start", "last_codec_end", "end"]
    assert 0 <= ms["submit"] and [ms[name] for name in end] == sorted(ms[name] for name in end)
    assert ms["first_codec_start"] < ms["last_codec_start"]  # FRAMES make more than one chunk
    assert line["prefill_batch"] >= 1 and line["running"] >= 0 and line["first_codec_batch"] >= 1
    summary = summarise([line, line])
    assert set(summary["steps"]) == {name for name, _, _ in STEPS} and summary["steps"]["first_audio"]["n"] == 2
    assert summary["steps"]["first_audio"]["p50"] == round(ms["first_sent"], 2)
    waves = split_waves([{"outcome": "ok", "i": i} for i in range(5)] + [{"outcome": "failed"}], 2, warmup=1)
    assert [r["i"] for r in waves["first wave"]] == [1, 2] and [r["i"] for r in waves["later"]] == [3, 4]


def test_a_checkpoint_that_fails_to_load_is_reported_and_the_engine_stops(tmp_path, monkeypatch):
    """The engine loads on its own loop and thread; a load that fails there reaches /health (503, status error)
    and every speech request (503 model_load_failed), and stopping the server stops the engine's thread."""
    import shutil

    from serving.engine.checkpoint import resolve_model

    ckpt = tmp_path / "broken"
    shutil.copytree(resolve_model("tiny-random"), ckpt)
    (ckpt / "model.safetensors").write_bytes(b"not a safetensors file")
    monkeypatch.setattr(ServerThread, "_wait_healthy", lambda self: None)
    broken = ServerThread(str(ckpt), tmp_path / "voices")
    try:
        deadline = time.monotonic() + 120
        while broken.server._startup_error is None and time.monotonic() < deadline:
            time.sleep(0.1)
        try:
            urllib.request.urlopen(broken.url + "/health", timeout=10)
            raise AssertionError("expected 503")
        except urllib.error.HTTPError as e:
            assert e.code == 503 and json.loads(e.read())["status"] == "error"
        status, _, body = post_json(broken.url + "/v1/audio/speech", {"input": "hi", "voice": "vivian"})
        assert status == 503 and json.loads(body)["error"]["code"] == "model_load_failed"
    finally:
        broken.stop()
    assert not broken.server.engine._thread.is_alive()
