"""Model-free sanity checks: a clean espeak-ng clip passes, and clips built to fail one check each are
flagged for that check alone."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.signal import resample_poly

from tests.quality_support import RATE, SENTENCES, espeak
from ttsbench.quality import sanity
from ttsbench.quality.audio import Clip, read_clip

TEXT = SENTENCES[0]  # "Please close the door behind you." ~2 s of speech


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> np.ndarray:
    return read_clip(espeak(tmp_path_factory.mktemp("sanity") / "clean.wav", TEXT)).samples


def kinds(result: dict) -> set[str]:
    return {sanity.flag_kind(f) for f in result["flags"]}


def check(samples: np.ndarray, rate: int = RATE, text: str = TEXT, **kw) -> dict:
    return sanity.check(Clip(np.asarray(samples, dtype=np.float32), rate, 1), text, **kw)


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), dtype=np.float32)


def test_clean_clip_passes(speech):
    result = check(speech, record_rate=RATE, expect_rate=RATE)
    assert result["flags"] == []
    assert result["expected_s"] == pytest.approx(sanity.expected_speech_s(TEXT), abs=1e-3)
    assert 0.5 < result["duration_s"] / result["expected_s"] < 2.0
    assert result["lead_silence_s"] < 0.2 and result["trail_silence_s"] < 0.5
    assert result["nonfinite"] == 0 and result["clipped_share"] == 0 and abs(result["dc_offset"]) < 0.01


def test_each_broken_clip_gets_its_own_flag(speech):
    cases = {
        "clipping": (np.clip(speech * 20, -1.0, 1.0), {}),
        "nonfinite": (np.where(np.arange(len(speech)) % 1000 == 0, np.nan, speech), {}),
        "dc_offset": (speech + 0.1, {}),
        "lead_silence": (np.concatenate([silence(3.0), speech]), {}),
        "trail_silence": (np.concatenate([speech, silence(3.0)]), {}),
        "silence": (np.concatenate([speech[: len(speech) // 2], silence(3.5), speech[len(speech) // 2:]]), {}),
        "silent": (silence(2.0), {}),
        "empty": (np.zeros(0), {}),
        "runaway": (np.tile(speech, 6), {}),
        "truncated": (speech[: int(0.4 * RATE)], {}),
    }
    for kind, (samples, kw) in cases.items():
        result = check(samples, **kw)
        assert kinds(result) == {kind}, (kind, result["flags"])


def test_nan_and_inf_are_counted_not_propagated(speech):
    broken = speech.copy()
    broken[100:110] = np.inf
    broken[200] = np.nan
    result = check(broken)
    assert result["nonfinite"] == 11 and result["flags"] == ["nonfinite: 11 NaN/Inf samples"]
    assert np.isfinite(result["dc_offset"]) and np.isfinite(result["silence_share"])


def test_sample_rate_checks(speech):
    low = resample_poly(speech, 1, 3)  # 8 kHz: intelligible but below what a TTS server should send
    assert kinds(check(low, rate=8000)) == {"sample_rate"}
    stated = check(speech, record_rate=22050)["flags"]
    assert stated == ["sample_rate: file says 24000 Hz, the stream said 22050 Hz"]
    assert check(speech, expect_rate=16000)["flags"] == ["sample_rate: 24000 Hz, expected 16000 Hz"]


def test_short_texts_are_not_called_truncated(speech):
    # "Hi." is expected to take ~0.15 s: a short clip for it is not a truncation
    assert check(speech[: int(0.3 * RATE)], text="Hi.")["flags"] == []


def test_expected_duration_model():
    assert sanity.expected_speech_s("Hello, world!") == pytest.approx(10 / 13)        # letters only
    assert sanity.expected_speech_s("\u4eca\u5929\u5929\u6c14\u5f88\u597d\u3002") == pytest.approx(6 / 4.5)
    assert sanity.expected_speech_s("\u3053\u3093\u306b\u3061\u306f") == pytest.approx(5 / 8)   # kana
    assert sanity.expected_speech_s("\uc548\ub155\ud558\uc138\uc694") == pytest.approx(5 / 6)   # Hangul
    assert sanity.expected_speech_s("Room 101") == pytest.approx(4 / 13 + 3 / 4)
    assert sanity.expected_speech_s("...") == 0.0
