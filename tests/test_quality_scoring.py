"""Which clips are scored, and the summary figures recomputed from quality.jsonl rows by hand."""

from __future__ import annotations

import pytest

from tests.quality_support import record
from ttsbench.datasets import datasets_dir
from ttsbench.quality.scoring import aggregate, resolve_ref_audio, select


def _row(rid, level, language, wer, errors, units, sim, flags=()):
    return {"id": rid, "task": "custom", "set": "multilingual", "level": level, "language": language,
            "wer": wer, "errors": errors, "ref_units": units, "sim": sim, "flags": list(flags),
            "sim_kind": "consistency"}


def test_aggregate_by_hand():
    rows = [
        _row("a", "c1", "English", 0.2, 1, 5, 0.8),
        _row("b", "c1", "Chinese", 0.1, 1, 10, 0.6, ["truncated: 0.4 s of speech for ~2.0 s of text"]),
        _row("c", "c8", "English", 1.0, 5, 5, None, ["silent: no frame above -60 dBFS", "runaway: 9 s"]),
        _row("d", "c8", "English", None, None, None, None, ["unreadable: audio/d.wav: bad header"]),
    ]
    (q,) = aggregate(rows, "whisper", "base", "resemblyzer")
    assert q["n_clips"] == 4 and q["wer_n"] == 3 and q["sim_n"] == 2
    assert q["wer_mean"] == pytest.approx((0.2 + 0.1 + 1.0) / 3, abs=1e-4)
    assert q["wer_corpus"] == pytest.approx(7 / 20, abs=1e-4)              # (1 + 1 + 5) / (5 + 10 + 5)
    assert q["sim_mean"] == pytest.approx(0.7) and q["sim_kind"] == "consistency"
    assert q["flagged_share"] == 0.75 and q["flagged_n"] == 4
    assert q["flag_counts"] == {"runaway": 1, "silent": 1, "truncated": 1, "unreadable": 1}
    en, zh = q["by_language"]["English"], q["by_language"]["Chinese"]
    assert (en["wer_n"], en["wer_mean"], en["wer_corpus"]) == (2, 0.6, 0.6)
    assert (zh["wer_n"], zh["wer_mean"], zh["flagged_share"]) == (1, 0.1, 1.0)
    c1, c8 = q["by_level"]["c1"], q["by_level"]["c8"]
    assert (c1["wer_mean"], c1["sim_mean"], c1["flagged_share"]) == (0.15, 0.7, 0.5)
    assert (c8["wer_mean"], c8["sim_n"], c8["flagged_share"]) == (1.0, 0, 1.0)


def test_select_scores_completed_non_warmup_requests_up_to_the_limit():
    records = [record(f"custom/short/c1/{i}", "custom", "short", "Hi.", f"audio/{i}.wav") for i in range(4)]
    records += [record("custom/short/c1/warmup-0", "custom", "short", "Hi.", "audio/w.wav", warmup=True),
                record("custom/short/c1/9", "custom", "short", "Hi.", None, ok=False),
                record("clone/short/c1/0", "clone", "short", "Hi.", "audio/k.wav")]
    assert [r["id"] for r in select(records, None)] == [
        "custom/short/c1/0", "custom/short/c1/1", "custom/short/c1/2", "custom/short/c1/3", "clone/short/c1/0"]
    assert [r["id"] for r in select(records, 2)] == ["custom/short/c1/0", "custom/short/c1/1", "clone/short/c1/0"]


def test_reference_clip_paths(tmp_path):
    assert resolve_ref_audio("voices/en_us_male.wav", tmp_path) == datasets_dir() / "voices" / "en_us_male.wav"
    (tmp_path / "mine.wav").write_bytes(b"")
    assert resolve_ref_audio("mine.wav", tmp_path) == tmp_path / "mine.wav"      # beside the run
    assert resolve_ref_audio(str(tmp_path / "mine.wav"), tmp_path / "elsewhere") == tmp_path / "mine.wav"
