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


def test_an_interrupted_step_continues_where_it_stopped(tmp_path, monkeypatch):
    import json

    import numpy as np

    from tests.quality_support import write_run, write_wav
    from ttsbench.quality import scoring

    tone = 0.3 * np.sin(np.linspace(0, 2000, 24000)).astype(np.float32)
    records = []
    for i in range(4):
        write_wav(tmp_path / "audio" / f"{i}.wav", tone)
        records.append(record(f"custom/short/c1/{i}", "custom", "short", "Hello there.", f"audio/{i}.wav"))
    write_run(tmp_path, records)
    options = scoring.Options(asr="none", sim="none")
    scored = []
    real = scoring._score_clip
    monkeypatch.setattr(scoring, "_score_clip", lambda rec, *a: scored.append(rec["id"]) or real(rec, *a))

    def stop_after_two(done, total):
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        scoring.score_run(tmp_path, options, progress=stop_after_two)
    partial = (tmp_path / scoring.PARTIAL).read_text().splitlines()
    assert len(partial) == 3 and not (tmp_path / "quality.jsonl").exists()
    with (tmp_path / scoring.PARTIAL).open("a") as f:
        f.write('{"row": {"id": "custom/sho')                       # a crash in the middle of a line
    scored.clear()
    (q,) = scoring.score_run(tmp_path, options)
    assert scored == ["custom/short/c1/2", "custom/short/c1/3"] and q["n_clips"] == 4
    assert not (tmp_path / scoring.PARTIAL).exists()
    assert len((tmp_path / "quality.jsonl").read_text().splitlines()) == 4
    # other options: nothing is reused
    with pytest.raises(KeyboardInterrupt):
        scoring.score_run(tmp_path, options, progress=stop_after_two)
    scored.clear()
    scoring.score_run(tmp_path, scoring.Options(asr="none", sim="none", expect_rate=16000))
    assert len(scored) == 4
    rows = [json.loads(line) for line in (tmp_path / "quality.jsonl").read_text().splitlines()]
    assert all("sample_rate: 24000 Hz, expected 16000 Hz" in r["flags"] for r in rows)
