"""Audio in and out of the API: response encoding, streaming framing, reference clip decoding, speed.

The model speaks 24 kHz mono float32 in [-1, 1]; everything leaves as s16le PCM or a file built from it.
MP3 and Ogg/Opus come from libsndfile (>= 1.1, bundled with the soundfile wheels), so no ffmpeg is needed.
"""

from __future__ import annotations

import base64
import binascii
import io
import struct

import numpy as np
import orjson
import soundfile as sf

from serving.model.config import SAMPLE_RATE

CONTENT_TYPES = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
}
_SOUNDFILE_FORMATS = {"flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"), "opus": ("OGG", "OPUS")}


class AudioError(ValueError):
    """A reference clip that cannot be used (bad base64, undecodable, wrong length)."""


def to_pcm16(samples: np.ndarray) -> bytes:
    """float32 [-1, 1] -> little-endian int16 bytes (clipped, rounded like the official wav writer)."""
    clipped = np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0)
    return (clipped * 32767.0).round().astype("<i2").tobytes()


def wav_header(n_data_bytes: int | None, sample_rate: int = SAMPLE_RATE) -> bytes:
    """A 44-byte PCM16 mono WAV header; `None` writes 0xFFFFFFFF sizes for a stream of unknown length."""
    data_size = 0xFFFFFFFF if n_data_bytes is None else n_data_bytes
    riff_size = 0xFFFFFFFF if n_data_bytes is None else 36 + n_data_bytes
    return (b"RIFF" + struct.pack("<I", riff_size) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
            + b"data" + struct.pack("<I", data_size))


def encode(samples: np.ndarray, fmt: str, sample_rate: int = SAMPLE_RATE) -> bytes:
    """A whole response body in `fmt` (one of CONTENT_TYPES)."""
    if fmt == "pcm":
        return to_pcm16(samples)
    if fmt == "wav":
        pcm = to_pcm16(samples)
        return wav_header(len(pcm), sample_rate) + pcm
    container, subtype = _SOUNDFILE_FORMATS[fmt]
    buf = io.BytesIO()
    # From the same int16 samples as wav/pcm, so a lossless format holds exactly the PCM answer.
    data = np.frombuffer(to_pcm16(samples), dtype="<i2")
    if len(data) == 0:  # encoders reject empty input; a tenth of a second of silence is still a valid file
        data = np.zeros(sample_rate // 10, dtype=np.int16)
    sf.write(buf, data, sample_rate, format=container, subtype=subtype)
    return buf.getvalue()


def sse_event(payload: dict) -> bytes:
    """One event, every streamed chunk's: orjson writes a delta's ~26 kB of base64 in ~2 us, json.dumps in ~57
    (development VM), on the server's event loop."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def sse_delta(pcm: bytes) -> bytes:
    """OpenAI's `speech.audio.delta` event carrying base64 s16le PCM."""
    return sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(pcm).decode("ascii")})


def sse_done(usage: dict) -> bytes:
    return sse_event({"type": "speech.audio.done", "usage": usage})


def decode_data_uri(uri: str) -> bytes:
    """`data:[<mime>][;base64],<payload>` -> bytes; plain base64 without the prefix is accepted too."""
    payload = uri
    if uri.startswith("data:"):
        header, sep, payload = uri.partition(",")
        if not sep or not header.endswith(";base64"):
            raise AudioError("ref_audio data URI must be base64 encoded (data:audio/wav;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise AudioError(f"ref_audio is not valid base64: {exc}") from None


def decode_clip(data: bytes, *, min_s: float = 1.0, max_s: float = 30.0) -> np.ndarray:
    """Any format libsndfile reads -> mono float32 at 24 kHz, its duration checked."""
    if not data:
        raise AudioError("reference audio is empty")
    try:
        samples, sr = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as exc:  # libsndfile raises several types for junk input
        raise AudioError(f"reference audio could not be decoded ({exc}); send WAV, FLAC, MP3 or Ogg") from None
    mono = samples.mean(axis=1)
    duration = len(mono) / sr if sr else 0.0
    if not min_s <= duration <= max_s:
        raise AudioError(f"reference audio must last {min_s:g}-{max_s:g} s, got {duration:.2f} s")
    if not np.isfinite(mono).all():
        raise AudioError("reference audio holds non-finite samples")
    if sr != SAMPLE_RATE:
        import soxr

        mono = soxr.resample(mono, sr, SAMPLE_RATE).astype(np.float32)
    return np.ascontiguousarray(mono, dtype=np.float32)


def time_stretch(samples: np.ndarray, speed: float, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Change tempo without changing pitch (WSOLA): `speed` 2.0 plays twice as fast.

    Each output frame takes the input window, near its nominal position, that best continues the
    previous one, so the waveform stays phase-aligned and no pitch shift or clicks appear.
    """
    x = np.asarray(samples, dtype=np.float32)
    if speed == 1.0 or len(x) == 0:
        return x
    win = int(0.03 * sample_rate)
    hop_out = win // 2
    tol = win // 4
    window = np.hanning(win).astype(np.float32)
    n_out = int(round(len(x) / speed))
    padded = np.concatenate([np.zeros(tol, np.float32), x, np.zeros(win + tol + hop_out, np.float32)])
    out = np.zeros(n_out + win, np.float32)
    norm = np.zeros(n_out + win, np.float32)
    prev = None
    for k in range((n_out + hop_out - 1) // hop_out + 1):
        nominal = tol + int(k * hop_out * speed)
        if nominal + win + tol > len(padded):
            break
        if prev is None:
            start = nominal
        else:
            target = padded[prev + hop_out: prev + hop_out + win]
            region = padded[nominal - tol: nominal + tol + win]
            start = nominal - tol + int(np.argmax(np.correlate(region, target, mode="valid")))
        o = k * hop_out
        if o >= n_out:
            break
        out[o:o + win] += padded[start:start + win] * window
        norm[o:o + win] += window
        prev = start
    norm[norm < 1e-3] = 1.0
    return (out / norm)[:n_out]
