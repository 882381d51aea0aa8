"""Voice clone (Base) and VoiceDesign checkpoints end to end: voices upload/use/list/delete/restart, API key."""

import base64
import hashlib
import io
import json
import types
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from serving.api import audio
from serving.api import server as server_module
from tests.server_fixtures import ServerThread, post_json

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
VOICE_WAV = REPO / "datasets" / "voices" / "en_us_female.wav"
KEY = {"Authorization": "Bearer secret"}
FRAMES = 5


def multipart(fields: dict, files: dict) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    out = b""
    for name, value in fields.items():
        out += (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n").encode()
    for name, (filename, data, ctype) in files.items():
        out += (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"; filename=\"{filename}\"\r\n"
                f"Content-Type: {ctype}\r\n\r\n").encode() + data + b"\r\n"
    return out + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def call(url, method="GET", data=None, headers=None):
    req = urllib.request.Request(url, data=data, method=method, headers={**KEY, **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def upload(server, name, fields=None, files=None):
    body, ctype = multipart({"name": name, "consent": "speaker agreed", "ref_text": "Hello.", **(fields or {})},
                            files if files is not None else {"audio_sample": ("v.wav", VOICE_WAV.read_bytes(),
                                                                              "audio/wav")})
    return call(server.url + "/v1/audio/voices", "POST", body, {"Content-Type": ctype})


def clone(server, **fields):
    body = {"input": "Cloned speech.", "max_new_tokens": FRAMES, "seed": 3, "response_format": "pcm", **fields}
    return post_json(server.url + "/v1/audio/speech", body, headers=KEY)


@pytest.fixture(scope="module")
def voices_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("voices")


@pytest.fixture(scope="module")
def base(voices_dir):
    srv = ServerThread("tiny-random-clone", voices_dir, api_key="secret", max_batch_size=2)
    yield srv
    srv.stop()


def test_api_key_is_required(base):
    status, _, body = post_json(base.url + "/v1/audio/speech", {"input": "x"})
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    with urllib.request.urlopen(base.url + "/health") as r:  # health and metrics stay open for probes
        assert r.status == 200


def test_inline_reference_clip_and_embedding(base):
    uri = "data:audio/wav;base64," + base64.b64encode(VOICE_WAV.read_bytes()).decode()
    status, headers, icl = clone(base, ref_audio=uri, ref_text="Hello there.", task_type="Base")
    assert status == 200 and len(icl) == FRAMES * 1920 * 2, icl[:300]
    status, _, xvec = clone(base, ref_audio=uri, x_vector_only_mode=True, voice="alloy")
    assert status == 200 and xvec != icl
    status, _, emb = clone(base, speaker_embedding=[0.1] * 64)
    assert status == 200 and len(emb) == FRAMES * 1920 * 2
    streamed = clone(base, ref_audio=uri, ref_text="Hello there.", stream=True)[2]
    assert np.abs(np.frombuffer(streamed, "<i2").astype(int) - np.frombuffer(icl, "<i2")).max() <= 2


def test_an_inline_reference_is_encoded_once_and_reused(base, monkeypatch):
    """The same inline clip sent again is neither unpacked from base64, hashed nor decoded (the server keeps
    decoded clips by the data URI's text, with the voice key hashed once) nor encoded again (the engine's voice
    cache), and still sounds the same for the same seed; another clip is a new entry in both."""
    runner = base.server.engine.runner
    wav = VOICE_WAV.read_bytes()
    uri = "data:audio/wav;base64," + base64.b64encode(wav).decode()
    encoded = []
    encode = runner.prompts.encode_reference
    runner.prompts.encode_reference = lambda audio: encoded.append(1) or encode(audio)
    runner._voice_cache.clear()  # earlier tests may have sent this clip
    base.server._clips.clear()
    decoded, unpacked, hashed = [], [], []
    decode, decode_uri = base.server._decode_clip, audio.decode_data_uri
    base.server._decode_clip = lambda data, param: decoded.append(1) or decode(data, param)
    audio.decode_data_uri = lambda text: unpacked.append(1) or decode_uri(text)
    monkeypatch.setattr(server_module, "hashlib", types.SimpleNamespace(
        sha256=lambda data: hashed.append(1) or hashlib.sha256(data)))
    try:
        first = clone(base, ref_audio=uri, ref_text="Hello there.", seed=11)
        second = clone(base, ref_audio=uri, ref_text="Hello there.", seed=11)
        assert first[0] == second[0] == 200 and first[2] == second[2]
        assert len(encoded) == len(decoded) == len(unpacked) == len(hashed) == 1  # the second reused the first's work
        data, sr = sf.read(io.BytesIO(wav), dtype="float32")
        buf = io.BytesIO()
        sf.write(buf, data * 0.5, sr, format="WAV")  # another clip: the same words, quieter
        other = "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode()
        assert clone(base, ref_audio=other, ref_text="Hello.", seed=11)[0] == 200
    finally:
        runner.prompts.encode_reference = encode
        base.server._decode_clip, audio.decode_data_uri = decode, decode_uri
    assert len(encoded) == 2 and len(decoded) == 2 and sum(k.startswith("inline:") for k in runner._voice_cache) == 2  # a new clip, a new entry


@pytest.mark.parametrize("fields,param", [
    ({"ref_audio": "data:audio/wav;base64,AAAA"}, "ref_audio"),  # decodes, but is no audio
    ({"ref_audio": "data:audio/wav;base64,%%%"}, "ref_audio"),
    ({"ref_audio": "unknown-voice"}, "ref_audio"),
    ({"voice": "unknown-voice"}, "voice"),
    ({"speaker_embedding": [0.1] * 63}, "speaker_embedding"),
    ({"ref_audio": "data:audio/wav;base64," + base64.b64encode(VOICE_WAV.read_bytes()).decode()}, "ref_text"),
    ({}, "ref_audio"),
])
def test_clone_errors_then_a_good_request(base, fields, param):
    status, _, body = clone(base, **fields)
    assert status == 400 and json.loads(body)["error"]["param"] == param
    assert clone(base, speaker_embedding=[0.2] * 64)[0] == 200


def test_short_reference_audio_is_refused(base):
    import io
    import soundfile as sf
    buf = io.BytesIO()
    sf.write(buf, np.zeros(12000, np.float32), 24000, format="WAV")
    uri = "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode()
    status, _, body = clone(base, ref_audio=uri, ref_text="x")
    assert status == 400 and "1-30 s" in json.loads(body)["error"]["message"]


def test_voices_upload_use_list_delete_and_survive_restart(base, voices_dir):
    assert upload(base, "Alice")[0] == 200
    assert upload(base, "alice")[0] == 409
    assert upload(base, "../etc")[0] == 400
    assert upload(base, "nofile", files={})[0] == 400
    assert upload(base, "big", files={"audio_sample": ("b.wav", b"0" * (11 * 1024 * 1024), "audio/wav")})[0] == 413
    assert upload(base, "junk", files={"audio_sample": ("j.wav", b"not audio at all", "audio/wav")})[0] == 400
    status, body = call(base.url + "/v1/audio/voices")
    listed = json.loads(body)
    assert status == 200 and [v["name"] for v in listed["uploaded_voices"]] == ["alice"]
    assert listed["uploaded_voices"][0]["ref_text"] == "Hello." and "consent" not in listed["uploaded_voices"][0]
    by_voice = clone(base, voice="ALICE")
    by_ref = clone(base, ref_audio="alice")
    assert by_voice[0] == 200 and by_voice[2] == by_ref[2]
    emb_fields = {"speaker_embedding": json.dumps([0.3] * 64)}
    assert upload(base, "bob", fields=emb_fields, files={})[0] == 200
    assert clone(base, voice="bob")[0] == 200
    restarted = ServerThread("tiny-random-clone", voices_dir, api_key="secret", max_batch_size=1)
    try:
        assert clone(restarted, voice="alice")[2] == by_voice[2]
        names = [v["name"] for v in json.loads(call(restarted.url + "/v1/audio/voices")[1])["uploaded_voices"]]
        assert names == ["alice", "bob"]
        assert call(restarted.url + "/v1/audio/voices/alice", "DELETE")[0] == 200
        assert call(restarted.url + "/v1/audio/voices/alice", "DELETE")[0] == 404
        assert clone(restarted, voice="alice")[0] == 400
    finally:
        restarted.stop()


def test_voice_design(tmp_path):
    srv = ServerThread("tiny-random-design", tmp_path, max_batch_size=2)
    try:
        body = {"input": "Designed.", "instructions": "A warm, low voice.", "voice": "alloy", "seed": 1,
                "max_new_tokens": FRAMES, "response_format": "pcm"}
        status, _, whole = post_json(srv.url + "/v1/audio/speech", body)
        assert status == 200 and len(whole) == FRAMES * 1920 * 2
        status, _, streamed = post_json(srv.url + "/v1/audio/speech", {**body, "stream": True})
        assert streamed == whole
        other = post_json(srv.url + "/v1/audio/speech", {**body, "instructions": "A bright child's voice."})[2]
        assert other != whole
        status, _, err = post_json(srv.url + "/v1/audio/speech", {"input": "x", "max_new_tokens": 2})
        assert status == 400 and json.loads(err)["error"]["param"] == "instructions"
        assert post_json(srv.url + "/v1/audio/speech", body)[2] == whole
        status, body_ = call(srv.url + "/v1/audio/voices")
        assert status == 200 and json.loads(body_)["voices"] == []
    finally:
        srv.stop()
