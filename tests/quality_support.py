"""Real speech for the quality tests: espeak-ng clips, and run directories shaped as docs/run-format.md says."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

RATE = 24000

# Sentences espeak-ng speaks clearly enough for whisper base (checked: WER 0 on each).
SENTENCES = (
    "Please close the door behind you.",
    "Thank you so much for your help.",
    "The weather is very nice today.",
)


def need_espeak() -> None:
    if not (shutil.which("espeak-ng") and shutil.which("sox")):
        pytest.fail("espeak-ng and sox are needed (bash scripts/setup.sh --test installs them)")


def espeak(path: Path, text: str, voice: str = "en-us", rate: int = RATE) -> Path:
    """`text` spoken by espeak-ng `voice`, as a 16-bit mono WAV at `rate` (as a TTS server would send)."""
    need_espeak()
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(f"espeak-ng -v {voice} --stdout \"{text}\" | sox -V1 -D -t wav - -r {rate} -c 1 -b 16 {path}",
                   shell=True, check=True)
    return path


def write_wav(path: Path, samples: np.ndarray, rate: int = RATE, subtype: str = "PCM_16") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(path), samples, rate, subtype=subtype)
    return path


def record(rid: str, task: str, set_: str, text: str, audio_path: str | None, *, voice: str | None = None,
           ref_audio_path: str | None = None, language: str = "English", ok: bool = True,
           warmup: bool = False, sample_rate: int = RATE) -> dict:
    """One requests.jsonl line with every field of the format (timings are plausible constants)."""
    return {
        "id": rid, "item_id": rid.split("/")[-1], "task": task, "set": set_, "language": language,
        "text": text, "voice": voice, "instructions": "a calm voice" if task == "design" else None,
        "ref_audio_path": ref_audio_path, "ref_text": "reference" if ref_audio_path else None,
        "mode": "concurrency", "level": "c1", "concurrency": 1, "rate": None, "warmup": warmup,
        "stream": True, "ok": ok, "error": None if ok else "http_500",
        "error_detail": None if ok else "boom", "http_status": 200 if ok else 500, "t_start": 1.0,
        "t_headers_ms": 10.0, "ttfab_ms": 50.0 if ok else None, "e2e_ms": 900.0 if ok else None,
        "chunks": [[50.0, 4800]] if ok else [], "bytes": 4800 if ok else 0,
        "sample_rate": sample_rate if ok else None, "audio_s": 2.0 if ok else None, "rtf": 0.45 if ok else None,
        "n_chunks": 1 if ok else 0, "max_gap_ms": 0.0 if ok else None, "underrun_s": 0.0 if ok else None,
        "underrun_max_s": 0.0 if ok else None, "underrun_buffered_s": 0.0 if ok else None,
        "audio_path": audio_path,
    }


def write_run(run_dir: Path, records: list[dict], summary: dict | None = None) -> Path:
    """run.json, requests.jsonl and (optionally) summary.json of a finished run."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.json").write_text(json.dumps({
        "version": 1, "ttsbench_version": "0.1.0", "command": ["ttsbench", "run"], "label": "quality-test",
        "url": "http://127.0.0.1:1", "embedded_server": None, "server": None, "config": {},
        "host": {}, "packages": {}, "started_at": "2026-01-01T00:00:00+00:00",
        "finished_at": "2026-01-01T00:01:00+00:00"}), encoding="utf-8")
    (run_dir / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
    return run_dir
