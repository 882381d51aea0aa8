"""Reading saved clips and resampling them for the models (whisper and the speaker encoders want 16 kHz)."""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd
from pathlib import Path

import numpy as np

MODEL_RATE = 16000


@dataclass
class Clip:
    """Samples as float32 in [-1, 1] (mixed to mono), as stored: NaN/Inf and clipping are kept for the
    sanity checks to see; `finite()` gives what the models may be fed."""
    samples: np.ndarray
    sample_rate: int
    channels: int

    @property
    def duration_s(self) -> float:
        return len(self.samples) / self.sample_rate if self.sample_rate else 0.0

    def finite(self) -> np.ndarray:
        return np.nan_to_num(self.samples, nan=0.0, posinf=1.0, neginf=-1.0)

    def at(self, rate: int = MODEL_RATE) -> np.ndarray:
        return resample(self.finite(), self.sample_rate, rate)


def read_clip(path: Path) -> Clip:
    """A clip from a WAV/FLAC file; raises soundfile's error (with the path) when it cannot be read."""
    import soundfile as sf

    data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    return Clip(data.mean(axis=1).astype(np.float32), int(rate), int(data.shape[1]))


def resample(samples: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Polyphase resampling (scipy), exact for the integer ratios TTS rates have (24k/16k = 3/2)."""
    if rate == target or len(samples) == 0:
        return samples.astype(np.float32)
    from scipy.signal import resample_poly

    g = gcd(rate, target)
    return resample_poly(samples, target // g, rate // g).astype(np.float32)
