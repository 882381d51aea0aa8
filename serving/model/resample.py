"""Reference audio to mono float32 at the rate a model needs (24 kHz for the codec encoder and speaker encoder).

The official code resamples with librosa.resample, whose default is soxr at "HQ" quality followed by a fix to
ceil(n * target / source) samples. Calling soxr the same way gives the same samples (so the same codes and
x-vector) without pulling in librosa.
"""

from __future__ import annotations

import io
import math

import numpy as np
import soundfile as sf
import soxr


def to_mono(audio: np.ndarray) -> np.ndarray:
    """(samples,) or (samples, channels) -> (samples,) float32, channels averaged."""
    audio = np.asarray(audio, dtype=np.float32)
    if audio.ndim == 2:
        audio = audio.mean(axis=1, dtype=np.float32)
    if audio.ndim != 1:
        raise ValueError(f"audio must be (samples,) or (samples, channels), got shape {audio.shape}")
    return audio


def resample(audio: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """Mono float32 audio from orig_sr to target_sr, as librosa.resample(res_type="soxr_hq", fix=True)."""
    audio = to_mono(audio)
    if orig_sr <= 0 or target_sr <= 0:
        raise ValueError(f"sample rates must be positive, got {orig_sr} -> {target_sr}")
    if orig_sr == target_sr:
        return audio
    out = soxr.resample(audio, orig_sr, target_sr, quality="soxr_hq")
    n = int(math.ceil(audio.shape[0] * float(target_sr) / orig_sr))
    if out.shape[0] < n:
        out = np.pad(out, (0, n - out.shape[0]))
    return np.asarray(out[:n], dtype=np.float32)


def read_audio(source: str | bytes) -> tuple[np.ndarray, int]:
    """A path or the bytes of an audio file (WAV, FLAC, OGG: whatever libsndfile reads) -> (mono float32, rate)."""
    try:
        audio, sr = sf.read(io.BytesIO(source) if isinstance(source, bytes) else source, dtype="float32",
                            always_2d=False)
    except (sf.LibsndfileError, RuntimeError, TypeError) as exc:
        raise ValueError(f"cannot read reference audio: {exc}") from exc
    if audio.size == 0:
        raise ValueError("reference audio is empty")
    return to_mono(audio), int(sr)


def load_audio(source: str | bytes, target_sr: int) -> np.ndarray:
    """Read and resample to target_sr, in one step."""
    audio, sr = read_audio(source)
    return resample(audio, sr, target_sr)
