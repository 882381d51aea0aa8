"""Response encoding, stream framing and reference clip decoding, checked by reading the bytes back."""

import base64
import io
import json
import struct

import numpy as np
import pytest
import soundfile as sf

from serving.api import audio


def tone(seconds=1.0, hz=220.0, sr=audio.SAMPLE_RATE):
    t = np.arange(int(seconds * sr)) / sr
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def dominant_hz(x, sr=audio.SAMPLE_RATE):
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return np.fft.rfftfreq(len(x), 1 / sr)[spectrum.argmax()]


def test_pcm_is_s16le_of_the_samples():
    x = np.array([0.0, 0.5, -0.5, 1.0, -1.0, 2.0], np.float32)
    assert np.frombuffer(audio.encode(x, "pcm"), "<i2").tolist() == [0, 16384, -16384, 32767, -32767, 32767]


@pytest.mark.parametrize("fmt,lossless", [("wav", True), ("flac", True), ("mp3", False), ("opus", False)])
def test_every_format_decodes_back_to_the_same_sound(fmt, lossless):
    x = tone()
    data = audio.encode(x, fmt)
    y, sr = sf.read(io.BytesIO(data), dtype="float32")
    assert sr == audio.SAMPLE_RATE
    if lossless:
        assert len(y) == len(x) and np.abs(y - x).max() < 1e-4
    else:
        assert abs(len(y) - len(x)) < 0.1 * len(x)
        assert abs(dominant_hz(y) - 220.0) < 5


def test_streaming_wav_header_has_unknown_sizes_and_the_fixed_one_exact_sizes():
    h = audio.wav_header(None)
    assert len(h) == 44 and h[:4] == b"RIFF" and h[8:16] == b"WAVEfmt "
    assert struct.unpack("<I", h[4:8])[0] == 0xFFFFFFFF and struct.unpack("<I", h[40:44])[0] == 0xFFFFFFFF
    assert struct.unpack("<IHHIIHH", h[16:36])[1:] == (1, 1, 24000, 48000, 2, 16)
    fixed = audio.encode(tone(0.1), "wav")
    assert struct.unpack("<I", fixed[40:44])[0] == len(fixed) - 44


def test_sse_events_carry_base64_pcm():
    pcm = audio.to_pcm16(tone(0.01))
    event = audio.sse_delta(pcm)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    payload = json.loads(event[6:])
    assert payload["type"] == "speech.audio.delta" and base64.b64decode(payload["audio"]) == pcm
    assert json.loads(audio.sse_done({"audio_seconds": 1})[6:])["type"] == "speech.audio.done"


def wav_bytes(x, sr):
    buf = io.BytesIO()
    sf.write(buf, x, sr, format="WAV")
    return buf.getvalue()


def test_data_uri_and_plain_base64_decode():
    data = b"\x00\x01hello"
    b64 = base64.b64encode(data).decode()
    assert audio.decode_data_uri(f"data:audio/wav;base64,{b64}") == data
    assert audio.decode_data_uri(b64) == data
    for bad in ("data:audio/wav;base64,@@@", "data:audio/wav,AAAA", "not base64!"):
        with pytest.raises(audio.AudioError):
            audio.decode_data_uri(bad)


def test_clips_are_resampled_to_24k_mono_and_length_checked():
    stereo = np.stack([tone(2.0, sr=16000), tone(2.0, sr=16000)], axis=1)
    y = audio.decode_clip(wav_bytes(stereo, 16000))
    assert len(y) == 48000 and y.dtype == np.float32 and abs(dominant_hz(y) - 220) < 2
    with pytest.raises(audio.AudioError, match="1-30 s"):
        audio.decode_clip(wav_bytes(tone(0.5), 24000))
    with pytest.raises(audio.AudioError, match="1-30 s"):
        audio.decode_clip(wav_bytes(np.zeros(24000 * 31, np.float32), 24000))
    with pytest.raises(audio.AudioError, match="could not be decoded"):
        audio.decode_clip(b"RIFF-not-really-a-wav-file")
    with pytest.raises(audio.AudioError, match="empty"):
        audio.decode_clip(b"")


@pytest.mark.parametrize("speed", [0.5, 1.5, 2.0])
def test_speed_changes_duration_not_pitch(speed):
    x = tone(2.0, 300.0)
    y = audio.time_stretch(x, speed)
    assert len(y) == round(len(x) / speed)
    assert abs(dominant_hz(y) - 300.0) < 3
    assert np.abs(y).max() <= 0.6
    assert audio.time_stretch(x, 1.0) is x
