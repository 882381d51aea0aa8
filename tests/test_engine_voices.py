"""A voice clone's new reference voice is encoded on the engine's voice thread, beside the talker's steps: other
requests keep generating and are admitted meanwhile, and an encoding's error fails only its own request."""

import asyncio
import base64
import io
import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from serving.engine.engine import VOICE_THREADS
from serving.engine.prompts import WITHOUT_CUDNN
from tests.server_fixtures import ServerThread, post_json, wait_until

pytestmark = pytest.mark.slow
VOICE_WAV = Path(__file__).resolve().parents[1] / "datasets" / "voices" / "en_us_female.wav"
FRAMES = 5
AUDIO_BYTES = FRAMES * 1920 * 2  # a clone's PCM
VOICES_ENCODED = 'ttsbench_engine_phase_seconds_count{phase="voice"}'  # /metrics: new voices encoded so far


def clone(server, timeout=60.0, **fields):
    body = {"input": "Cloned speech.", "max_new_tokens": FRAMES, "seed": 3, "response_format": "pcm", **fields}
    return post_json(server.url + "/v1/audio/speech", body, timeout=timeout)


def leave(server, uri):
    """Send a clone and close the connection after a second, before any answer."""
    try:
        clone(server, timeout=1.0, ref_audio=uri, ref_text="Hello.")
    except OSError:  # the client's timeout: it left
        pass


class Held:
    """A function that counts its calls and, once entered, waits for release() before running."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0
        self.entered, self.released = threading.Event(), threading.Event()

    def __call__(self, *args):
        self.calls += 1
        self.entered.set()
        assert self.released.wait(60)
        return self.fn(*args)

    def release(self):
        self.released.set()


def clip_uri(gain: float) -> str:
    """The test voice at another level: a clip (and voice) the server has not met."""
    data, sr = sf.read(VOICE_WAV, dtype="float32")
    buf = io.BytesIO()
    sf.write(buf, data * gain, sr, format="WAV")
    return "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    srv = ServerThread("tiny-random-clone", tmp_path_factory.mktemp("voices"), max_batch_size=2)
    yield srv
    srv.stop()


def test_start_up_warms_the_encoders_with_a_synthetic_clip(base, monkeypatch):
    """A process's first encoding sets up libraries (0.77 s on an H100): warm-up pays it, not the first clone."""
    runner = base.server.engine.runner
    assert "voice_encoders" in runner.warmup_s
    calls = []
    real = runner.prompts.encode_reference
    monkeypatch.setattr(runner.prompts, "encode_reference", lambda audio: calls.append(len(audio)) or real(audio))
    runner.prompts.warm_up_encoders()
    assert calls == [2 * 24000] and not runner._voice_cache  # a synthetic clip, not kept as a voice


def test_the_voice_thread_encodes_through_torchscript_as_the_modules_do(base):
    """The server's encoders run as TorchScript (the interpreter let go for a whole network): the same x-vector
    and codes as the Python modules give, to the bit."""
    prompts = base.server.engine.runner.prompts
    assert isinstance(prompts._speaker_net, torch.jit.ScriptModule)
    assert isinstance(prompts._codec_net, torch.jit.ScriptModule)
    clip = sf.read(VOICE_WAV, dtype="float32")[0]
    embedding, codes = prompts.encode_reference(clip)
    with torch.backends.cudnn.flags(enabled=False):
        assert torch.equal(embedding, prompts.model.speaker_encoder.embed(clip, 24000).float().cpu())
        assert torch.equal(codes, prompts.codec_encoder.encode([clip], 24000)[0].cpu())


@pytest.fixture
def encoder(base):
    """The runner's reference encoder, to hold or break it; restored after the test."""
    prompts = base.server.engine.runner.prompts
    real = prompts.encode_reference
    yield prompts, real
    prompts.encode_reference = real


def test_requests_run_while_a_new_voice_is_encoded(base, encoder):
    """A clone arrives first and its new voice's encoding is held; a request with an x-vector, sent after it, is
    admitted and finishes meanwhile. Released, the clone is served as the same request is once its voice is
    cached, and phase `voice` has one observation more."""
    prompts, real = encoder
    prompts.encode_reference = held = Held(real)
    voices_before = base.metrics().get(VOICES_ENCODED, 0.0)
    uri = clip_uri(0.7)
    first: list = []
    clone_thread = threading.Thread(target=lambda: first.append(clone(base, ref_audio=uri, ref_text="Hello.", seed=9)))
    clone_thread.start()
    try:
        assert held.entered.wait(30)
        status, _, audio = clone(base, speaker_embedding=[0.1] * 64)
        assert status == 200 and len(audio) == AUDIO_BYTES
        assert not held.released.is_set() and clone_thread.is_alive()  # the clone still waits on its voice
    finally:
        held.release()
        clone_thread.join(60)
    assert first[0][0] == 200 and len(first[0][2]) == AUDIO_BYTES
    again = clone(base, ref_audio=uri, ref_text="Hello.", seed=9)  # its voice cached now: no encoding
    assert again[0] == 200 and again[2] == first[0][2]
    assert base.metrics()[VOICES_ENCODED] == voices_before + 1


def test_an_encoding_error_fails_its_request_alone(base, encoder):
    prompts, real = encoder

    def broken(audio):
        raise ValueError("the reference clip is too short to clone")

    prompts.encode_reference = broken
    status, _, body = clone(base, ref_audio=clip_uri(0.6), ref_text="Hello.")
    assert status == 400 and "too short" in json.loads(body)["error"]["message"]
    prompts.encode_reference = real
    assert clone(base, ref_audio=clip_uri(0.6), ref_text="Hello.")[0] == 200  # not cached as broken
    assert clone(base, speaker_embedding=[0.1] * 64)[0] == 200


def test_new_voices_are_encoded_side_by_side(base, encoder):
    """As many clones as voice threads bring new voices at once: their encodings run at the same time (each one waits
    here until all have begun, which fewer threads could not do: one would fail after 20 s), and all are served as
    they are once their voices are cached."""
    prompts, real = encoder
    together = threading.Barrier(VOICE_THREADS, timeout=20)

    def side_by_side(audio):
        together.wait()
        return real(audio)

    prompts.encode_reference = side_by_side
    voices_before = base.metrics().get(VOICES_ENCODED, 0.0)
    uris = [clip_uri(0.31 + 0.01 * i) for i in range(VOICE_THREADS)]
    results: dict = {}
    threads = [threading.Thread(target=lambda u=u: results.update({u: clone(base, ref_audio=u, ref_text="Hello.")}))
               for u in uris]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results[u][0] for u in uris] == [200] * VOICE_THREADS
    assert base.metrics()[VOICES_ENCODED] == voices_before + VOICE_THREADS
    prompts.encode_reference = real
    for u in uris:  # cached now: no encoding, the same audio to a few steps of 16-bit PCM: what runs beside a request
        # (rows, codec calls, the encoding threads) differs between the two, and a CPU's float sums with it (a step of
        # one in 2 of 10 runs)
        again, first = (np.frombuffer(body, dtype="<i2").astype(np.int32)
                        for body in (clone(base, ref_audio=u, ref_text="Hello.")[2], results[u][2]))
        assert again.shape == first.shape and np.abs(again - first).max() <= 8
    assert base.metrics()[VOICES_ENCODED] == voices_before + VOICE_THREADS


@pytest.mark.parametrize("enabled", [True, False])
def test_cudnn_stays_off_until_the_last_overlapping_encoding_ends(enabled):
    """Two encodings overlap (the first ends while the second runs): cuDNN stays off for the second, and the last
    one out leaves the flag as it was before either began."""
    found = torch.backends.cudnn.enabled
    torch.backends.cudnn.enabled = enabled
    try:
        WITHOUT_CUDNN.__enter__()  # the first encoding
        WITHOUT_CUDNN.__enter__()  # the second, begun on another voice thread
        WITHOUT_CUDNN.__exit__(None, None, None)  # the first ends
        assert torch.backends.cudnn.enabled is False
        WITHOUT_CUDNN.__exit__(None, None, None)
        assert torch.backends.cudnn.enabled is enabled
    finally:
        torch.backends.cudnn.enabled = found


def test_a_fresh_clone_run_brings_the_server_a_new_voice_per_request(base, tmp_path):
    """`ttsbench run --clone-mode fresh` against the server: each request's voice is encoded (phase `voice`), though
    all four send the same reference voice."""
    before = base.metrics().get(VOICES_ENCODED, 0.0)
    proc = subprocess.run([sys.executable, "-c", "from ttsbench.cli import app; app()", "run", "--url", base.url,
                           "--task", "clone", "--clone-mode", "fresh", "--voice", "en_us_male", "--set", "short",
                           "--num-requests", "3", "--concurrency", "1", "--warmup", "1", "--max-new-tokens", "4",
                           "--no-save-audio", "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "requests.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(r["ok"] for r in records)  # the warm-up request's record too
    assert base.metrics()[VOICES_ENCODED] == before + 4  # a new voice each


def test_a_burst_of_one_new_clip_is_decoded_and_encoded_once(base, encoder, monkeypatch):
    """Four requests bring the same new clip at once: the server decodes it once (the others wait for that
    decoding, held here until all four handlers have the clip) and the engine encodes its voice in one job on
    its voice thread, which all four wait for."""
    prompts, real = encoder
    server = base.server
    arrived, decoded, encoded = [], [], []
    inline, decode = server._inline_clip, server._decode_clip

    async def counted_inline(ref):
        arrived.append(1)
        return await inline(ref)

    def held_decode(data, param):
        wait_until(lambda: len(arrived) == 4, 30)  # every handler has the clip
        decoded.append(1)
        return decode(data, param)

    monkeypatch.setattr(server, "_inline_clip", counted_inline)
    monkeypatch.setattr(server, "_decode_clip", held_decode)
    prompts.encode_reference = lambda audio: encoded.append(1) or real(audio)
    runner, jobs = base.server.engine.runner, []
    encode_voice = runner.encode_voice
    monkeypatch.setattr(runner, "encode_voice", lambda request: jobs.append(1) or encode_voice(request))
    uri = clip_uri(0.55)
    results: list = []
    threads = [threading.Thread(target=lambda i=i: results.append(clone(base, ref_audio=uri, ref_text="Hello.",
                                                                         seed=i))) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(r[0] for r in results) == [200] * 4 and len(arrived) == 4
    assert len(decoded) == 1 and len(encoded) == 1 and len(jobs) == 1  # one job on the voice thread, not four


def test_a_client_that_leaves_while_its_voice_is_encoded_frees_its_place_and_the_voice_is_kept(base, encoder):
    """Two requests wait on one new voice's encoding and the first one's client leaves: it leaves the queue at once,
    the encoding goes on, the second request is served, and the voice stays cached."""
    prompts, real = encoder
    waiting = lambda: base.server.engine.scheduler.num_waiting  # noqa: E731
    prompts.encode_reference = held = Held(real)
    uri = clip_uri(0.45)
    leaving = threading.Thread(target=leave, args=(base, uri))
    staying: list = []
    stays = threading.Thread(target=lambda: staying.append(clone(base, ref_audio=uri, ref_text="Hello.")))
    try:
        leaving.start()
        assert held.entered.wait(30)
        stays.start()
        assert wait_until(lambda: waiting() == 2)
        leaving.join(30)
        assert wait_until(lambda: waiting() == 1)  # the leaver's handler is cancelled as its connection closes
        assert not held.released.is_set()
    finally:
        held.release()
        stays.join(60)
    assert staying[0][0] == 200 and len(staying[0][2]) == AUDIO_BYTES
    assert clone(base, ref_audio=uri, ref_text="Hello.")[0] == 200 and held.calls == 1


def test_a_client_that_leaves_while_its_clip_is_decoded_does_not_fail_the_others(base, monkeypatch):
    """Requests that wait on one clip's decoding share it; the first one's client leaving cancels its own wait,
    not the decoding (shielded), so the second is served and the clip is decoded once."""
    server = base.server
    held, left = Held(server._decode_clip), []
    inline = server._inline_clip

    async def noting_who_leaves(ref):
        try:
            return await inline(ref)
        except asyncio.CancelledError:
            left.append(1)
            raise

    monkeypatch.setattr(server, "_decode_clip", held)
    monkeypatch.setattr(server, "_inline_clip", noting_who_leaves)
    uri = clip_uri(0.35)
    leaving = threading.Thread(target=leave, args=(base, uri))
    staying: list = []
    stays = threading.Thread(target=lambda: staying.append(clone(base, ref_audio=uri, ref_text="Hello.")))
    try:
        leaving.start()
        assert held.entered.wait(30)
        stays.start()
        leaving.join(30)
        assert wait_until(lambda: left)  # the leaver's handler is cancelled as its connection closes
    finally:
        held.release()
        stays.join(60)
    assert staying[0][0] == 200 and len(staying[0][2]) == AUDIO_BYTES and held.calls == 1
