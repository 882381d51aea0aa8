"""Model-free audio checks, always on: they catch broken output (noise, silence, runaway generation,
truncation, clipping, NaN) cheaply, before and independently of any ASR or speaker model.

Expected duration model (read speech, by script, so it also works for mixed text and language "Auto"):

    Han characters      4.5 per second   (Mandarin read speech: 4-5 syllables/s)
    kana                8   per second   (Japanese: 7-8 morae/s)
    Hangul syllables    6   per second   (Korean read speech: 5-7 syllables/s)
    other letters      13   per second   (English/European read speech, 150-170 words/min)
    digits              4   per second   (a digit is spoken as a word or part of one)

Silence is flagged where it is: before the first sound (`lead_silence`), after the last
(`trail_silence`), or in pauses between them (`silence`); `silent` when there is no sound at all.
`silence_share` reports the silent share of the whole clip.

A clip is `runaway` when its length exceeds max(2.5 x expected, expected + 4 s), and `truncated` when its
speech (length less leading and trailing silence) is under 0.4 x expected for texts expected to take at
least 1 s. The margins are wide on purpose: speaking rate varies between voices and instructions
("slowly", "fast") by up to 2x, while the failures we look for are larger (a model that never emits its
end token, a stream cut short).
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

import numpy as np

from ttsbench.quality.audio import Clip

_RATES = {"han": 4.5, "kana": 8.0, "hangul": 6.0, "letter": 13.0, "digit": 4.0}


def _script(ch: str) -> str | None:
    code = ord(ch)
    if 0x3400 <= code <= 0x9FFF or 0xF900 <= code <= 0xFAFF or 0x20000 <= code <= 0x3134F:
        return "han"
    if 0x3040 <= code <= 0x30FF or 0x31F0 <= code <= 0x31FF or 0xFF66 <= code <= 0xFF9F:
        return "kana"
    if 0xAC00 <= code <= 0xD7AF or 0x1100 <= code <= 0x11FF or 0x3130 <= code <= 0x318F:
        return "hangul"
    if ch.isdigit():
        return "digit"
    if unicodedata.category(ch).startswith("L"):
        return "letter"
    return None


def expected_speech_s(text: str) -> float:
    """Seconds a speaker needs for `text` at an ordinary read-speech rate (see the table above)."""
    total = 0.0
    for ch in unicodedata.normalize("NFKC", text):
        script = _script(ch)
        if script:
            total += 1.0 / _RATES[script]
    return total


@dataclass(frozen=True)
class Limits:
    """Thresholds of the checks. Levels in dBFS are of 20 ms frame RMS."""
    frame_s: float = 0.02
    silence_floor_db: float = -60.0   # a frame quieter than this is silence whatever the clip's level
    silence_below_peak_db: float = 40.0  # ... and so is one this far under the clip's loud frames (p95)
    max_lead_silence_s: float = 1.5
    max_trail_silence_s: float = 2.0
    max_pause_share: float = 0.5     # silent share between the first and last sound (spans of 2 s or more)
    clip_level: float = 0.999        # |sample| at or above this is clipped (int16 full scale is 0.99997)
    max_clipped_share: float = 0.001
    max_dc_offset: float = 0.02
    min_sample_rate: int = 16000
    runaway_ratio: float = 2.5
    runaway_margin_s: float = 4.0
    truncated_ratio: float = 0.4
    truncated_min_expected_s: float = 1.0


def _frame_rms(samples: np.ndarray, frame: int) -> np.ndarray:
    n = len(samples) // frame
    if n == 0:
        return np.sqrt(np.mean(samples.astype(np.float64) ** 2, keepdims=True))
    frames = samples[: n * frame].astype(np.float64).reshape(n, frame)
    return np.sqrt(np.mean(frames ** 2, axis=1))


def check(clip: Clip, text: str, record_rate: int | None = None, expect_rate: int | None = None,
          limits: Limits = Limits()) -> dict:
    """Measurements of one clip plus `flags`, a list of 'kind: reason' strings (empty when clean)."""
    flags: list[str] = []
    raw = clip.samples
    n = len(raw)
    rate = clip.sample_rate
    nonfinite = int(np.count_nonzero(~np.isfinite(raw)))
    samples = clip.finite()
    expected = expected_speech_s(text)
    out = {
        "sample_rate": rate, "channels": clip.channels, "duration_s": round(clip.duration_s, 3),
        "expected_s": round(expected, 3), "nonfinite": nonfinite,
    }

    if rate < limits.min_sample_rate:
        flags.append(f"sample_rate: {rate} Hz is below {limits.min_sample_rate} Hz")
    if expect_rate and rate != expect_rate:
        flags.append(f"sample_rate: {rate} Hz, expected {expect_rate} Hz")
    if record_rate and rate != record_rate:
        flags.append(f"sample_rate: file says {rate} Hz, the stream said {record_rate} Hz")
    if nonfinite:
        flags.append(f"nonfinite: {nonfinite} NaN/Inf samples")
    if n == 0:
        flags.append("empty: no samples")
        out.update(lead_silence_s=None, trail_silence_s=None, speech_s=0.0, silence_share=None,
                   clipped_share=None, dc_offset=None, flags=flags)
        return out

    clipped = float(np.count_nonzero(np.abs(samples) >= limits.clip_level)) / n
    dc = float(np.mean(samples, dtype=np.float64))
    if clipped > limits.max_clipped_share:
        flags.append(f"clipping: {clipped:.2%} of samples at full scale")
    if abs(dc) > limits.max_dc_offset:
        flags.append(f"dc_offset: mean {dc:+.3f} of full scale")

    frame = max(1, int(round(limits.frame_s * rate)))
    rms = _frame_rms(samples, frame)
    floor = 10 ** (limits.silence_floor_db / 20)
    threshold = max(floor, float(np.percentile(rms, 95)) * 10 ** (-limits.silence_below_peak_db / 20))
    voiced = np.flatnonzero(rms >= threshold)
    frame_s = frame / rate
    if len(voiced) == 0:
        lead = trail = clip.duration_s
        speech, share = 0.0, 1.0
        flags.append(f"silent: no frame above {limits.silence_floor_db:.0f} dBFS")
    else:
        lead = voiced[0] * frame_s
        trail = max(0.0, clip.duration_s - (voiced[-1] + 1) * frame_s)
        speech = max(0.0, clip.duration_s - lead - trail)
        share = 1.0 - len(voiced) / len(rms)
        if lead > limits.max_lead_silence_s:
            flags.append(f"lead_silence: {lead:.1f} s before the first sound")
        if trail > limits.max_trail_silence_s:
            flags.append(f"trail_silence: {trail:.1f} s after the last sound")
        span = voiced[-1] - voiced[0] + 1
        pauses = 1.0 - len(voiced) / span
        if span * frame_s >= 2.0 and pauses > limits.max_pause_share:
            flags.append(f"silence: {pauses:.0%} of the time between the first and last sound is silent")

    duration = clip.duration_s
    if duration > max(limits.runaway_ratio * expected, expected + limits.runaway_margin_s):
        flags.append(f"runaway: {duration:.1f} s of audio for ~{expected:.1f} s of text")
    if (expected >= limits.truncated_min_expected_s and len(voiced)
            and speech < limits.truncated_ratio * expected):
        flags.append(f"truncated: {speech:.1f} s of speech for ~{expected:.1f} s of text")

    out.update(lead_silence_s=round(lead, 3), trail_silence_s=round(trail, 3), speech_s=round(speech, 3),
               silence_share=round(share, 4), clipped_share=round(clipped, 6), dc_offset=round(dc, 5),
               flags=flags)
    return out


def flag_kind(flag: str) -> str:
    """The kind of a flag ('runaway: 31.0 s ...' -> 'runaway'), for counting flags by kind."""
    return flag.split(":", 1)[0]
