"""Builders of run directories exactly as docs/run-format.md describes them, for report and gate tests.

The records are synthetic but shaped like a real streaming server's: 24 kHz 16-bit PCM chunks whose
generation slows with load, so high levels starve the player (underruns) and a few requests fail.
Aggregates are computed here independently of ttsbench's own code, so the tests check the report and
gate against the format, not against themselves.
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import numpy as np

SAMPLE_RATE = 24000
CHUNK_S = 0.32                       # audio per streamed chunk
SLO = {"ttfab_ms": 400.0, "underrun_s": 0.0}
_STATS = (("mean", None), ("median", 50), ("p90", 90), ("p95", 95), ("p99", 99), ("max", None))
_METRICS = ("ttfab_ms", "e2e_ms", "rtf", "underrun_s", "max_gap_ms")


def stall_totals(chunks_ms: list[list[float]], sec_per_byte: float) -> tuple[float, float]:
    """Underrun of a player starting at the first audio: total and worst stall, seconds."""
    dry_at = chunks_ms[0][0] / 1000.0
    total = worst = 0.0
    for t_ms, n in chunks_ms:
        t = t_ms / 1000.0
        if t > dry_at:
            total += t - dry_at
            worst = max(worst, t - dry_at)
            dry_at = t
        dry_at += n * sec_per_byte
    return total, worst


def _record(rng: random.Random, task, set_, level, index, t_start, speed, mode, conc, rate,
            error: str | None, warmup=False) -> dict:
    """One request: chunk arrivals from a model where per-chunk generation time grows with load."""
    load = conc if conc else max(1.0, (rate or 8.0))
    audio_s = round(rng.uniform(1.2, 4.0), 3)
    n_samples = int(audio_s * SAMPLE_RATE)
    ttfab = speed * (60.0 + 35.0 * load) * rng.lognormvariate(0, 0.25)
    per_chunk_ms = speed * 1000 * CHUNK_S * 0.25 * load ** 0.7   # > 320 ms (real time) at high load
    chunks, t, left = [], ttfab, n_samples * 2
    while left > 0:
        n = min(left, int(CHUNK_S * SAMPLE_RATE) * 2)
        chunks.append([round(t, 3), n])
        left -= n
        t += per_chunk_ms * rng.lognormvariate(0, 0.3)
    rec = {
        "id": f"{task}/{set_}/{level}/{'warmup-' if warmup else ''}{index}", "item_id": f"{set_}-{index:03d}",
        "task": task, "set": set_, "language": "English" if index % 3 else "Chinese",
        "text": f"Synthetic sentence number {index} for the {set_} set.",
        "voice": "vivian" if task == "custom" else ("ref_en" if task == "clone" else None),
        "instructions": "calm, warm voice" if task == "design" else None,
        "ref_audio_path": "voices/ref_en.wav" if task == "clone" else None,
        "ref_text": "A reference transcript." if task == "clone" else None,
        "mode": mode, "level": level, "concurrency": conc, "rate": rate, "warmup": warmup, "session": 0,
        "stream": True, "t_start": round(t_start, 6), "audio_path": None,
    }
    if error:
        partial = chunks[:1] if error in ("truncated", "reset") else []
        rec.update({"ok": False, "error": error, "error_detail": _DETAIL[error],
                    "http_status": 500 if error == "http_500" else (200 if partial else None),
                    "t_headers_ms": round(ttfab * 0.5, 3) if error != "connect" else None,
                    "ttfab_ms": partial[0][0] if partial else None,
                    "e2e_ms": round(ttfab * 1.5, 3) if error != "connect" else None,
                    "chunks": partial, "bytes": sum(n for _, n in partial),
                    "sample_rate": SAMPLE_RATE if partial else None,
                    "audio_s": round(sum(n for _, n in partial) / 2 / SAMPLE_RATE, 6) if partial else None,
                    "rtf": None, "n_chunks": len(partial), "max_gap_ms": None,
                    "underrun_s": 0.0 if partial else None, "underrun_max_s": 0.0 if partial else None,
                    "underrun_buffered_s": 0.0 if partial else None})
        return rec
    e2e = chunks[-1][0] + 2.0
    spb = 1.0 / (2 * SAMPLE_RATE)
    total, worst = stall_totals(chunks, spb)
    gaps = [b[0] - a[0] for a, b in zip(chunks, chunks[1:])]
    rec.update({"ok": True, "error": None, "error_detail": None, "http_status": 200,
                "t_headers_ms": round(ttfab * 0.6, 3), "ttfab_ms": chunks[0][0], "e2e_ms": round(e2e, 3),
                "chunks": chunks, "bytes": n_samples * 2, "sample_rate": SAMPLE_RATE,
                "audio_s": round(n_samples / SAMPLE_RATE, 6), "rtf": round(e2e / 1000 / (n_samples / SAMPLE_RATE), 6),
                "n_chunks": len(chunks), "max_gap_ms": round(max(gaps), 3) if gaps else None,
                "underrun_s": round(total, 6), "underrun_max_s": round(worst, 6),
                "underrun_buffered_s": round(total, 6)})
    return rec


_DETAIL = {"timeout": "no response within 300 s", "http_500": "Internal Server Error: CUDA out of memory",
           "truncated": "stream ended before the WAV length", "connect": "Connection refused",
           "reset": "ServerDisconnectedError", "invalid_audio": "odd number of PCM bytes", "other": "?"}


def _stat(values: list[float], name: str, q) -> float | None:
    if not values:
        return None
    arr = np.asarray(values, dtype=float)
    if name == "mean":
        return round(float(arr.mean()), 6)
    if name == "max":
        return round(float(arr.max()), 6)
    return round(float(np.percentile(arr, q)), 6)


def summary_row(records: list[dict], slo: dict = SLO) -> dict:
    """The aggregates of one (task, set, level), per the format's definitions."""
    first = records[0]
    ok = [r for r in records if r["ok"]]
    duration = max(r["t_start"] + (r["e2e_ms"] or 0) / 1000 for r in records) - min(r["t_start"] for r in records)
    audio = sum(r["audio_s"] for r in ok)
    errors: dict[str, int] = {}
    for r in records:
        if r["error"]:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    good = [r for r in ok if r["ttfab_ms"] < slo["ttfab_ms"] and r["underrun_s"] <= slo["underrun_s"]]
    row = {"task": first["task"], "set": first["set"], "level": first["level"], "mode": first["mode"],
           "concurrency": first["concurrency"], "rate": first["rate"], "completed": len(ok),
           "failed": len(records) - len(ok), "errors": errors, "duration_s": round(duration, 6),
           "request_throughput": round(len(ok) / duration, 6), "audio_throughput": round(audio / duration, 6),
           "frames_per_s": round(audio / duration * 12.5, 6), "total_audio_s": round(audio, 6),
           "goodput": round(len(good) / len(records), 6)}
    for metric in _METRICS:
        vals = [r[metric] for r in ok if r[metric] is not None]
        for name, q in _STATS:
            row[f"{metric}_{name}"] = _stat(vals, name, q)
    return row


def make_run(path: Path, label: str = "base", groups=(("custom", "short"),), levels=("c1", "c2", "c4", "c8"),
             n_per_level: int = 12, speed: float = 1.0, seed: int = 0, failures: dict | None = None,
             quality: bool = False, wer_shift: float = 0.0, sim_shift: float = 0.0) -> Path:
    """Write a complete run directory. `levels` like c8 (concurrency) or r2.5 / rinf (rate);
    `failures` maps level -> list of error kinds for that many failed requests there;
    `speed` scales every latency (2.0 = twice as slow)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    failures = failures or {}
    mode = "rate" if levels[0].startswith("r") else "concurrency"
    records: list[dict] = []
    clock = 1000.0
    for task, set_ in groups:
        for level in levels:
            conc = int(level[1:]) if mode == "concurrency" else None
            rate = None if mode == "concurrency" or level == "rinf" else float(level[1:])
            records.append(_record(rng, task, set_, level, 0, clock, speed, mode, conc, rate, None, warmup=True))
            errs = list(failures.get(level, []))
            for i in range(n_per_level):
                error = errs.pop() if errs and i % 3 == 1 else None
                rec = _record(rng, task, set_, level, i, clock, speed, mode, conc, rate, error)
                records.append(rec)
                # closed loop: a new request each time one of `conc` in flight ends; open loop: every 1/rate s
                clock += (rec["e2e_ms"] or 0) / 1000 / conc if mode == "concurrency" else 1.0 / (rate or 20.0)
            assert not errs, "more failures than requests at a level"
            clock += 5.0
    with (path / "requests.jsonl").open("w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    measured = [r for r in records if not r["warmup"]]
    keys = list(dict.fromkeys((r["task"], r["set"], r["level"]) for r in measured))
    rows = [summary_row([r for r in measured if (r["task"], r["set"], r["level"]) == k]) for k in keys]
    summary = {"version": 1, "slo": SLO, "rows": rows, "quality": []}
    if quality:
        summary["quality"] = _write_quality(path, measured, rng, wer_shift, sim_shift)
    write_summary(path, summary)
    _write_run_json(path, label, groups, levels, mode, n_per_level)
    return path


def write_summary(path: Path, summary: dict) -> None:
    """summary.json and summary.csv (the rows, `errors` as a JSON cell)."""
    (path / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    rows = summary["rows"]
    if rows:
        with (path / "summary.csv").open("w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            for row in rows:
                w.writerow({**row, "errors": json.dumps(row["errors"], sort_keys=True)})


def edit_summary(path: Path, edit) -> Path:
    """Rewrite summary.json through `edit(summary) -> None` (crafting regressions for gate tests)."""
    summary = json.loads((path / "summary.json").read_text(encoding="utf-8"))
    edit(summary)
    write_summary(path, summary)
    return path


def _write_quality(path: Path, measured: list[dict], rng: random.Random, wer_shift: float,
                   sim_shift: float) -> list[dict]:
    clips = []
    for r in measured:
        if not r["ok"]:
            continue
        wer = max(0.0, rng.choice([0.0, 0.0, 0.0, 0.05, 0.1]) + wer_shift)
        flags = []
        if r["audio_s"] > 3.8:
            flags.append("too_long")
        if wer > 0.3:
            flags.append("high_wer")
        clips.append({"id": r["id"], "task": r["task"], "set": r["set"], "language": r["language"],
                      "asr_text": r["text"].lower(), "ref_text_norm": r["text"].lower(),
                      "hyp_text_norm": r["text"].lower(), "wer": round(wer, 4),
                      "unit": "char" if r["language"] == "Chinese" else "word",
                      "sim": round(rng.uniform(0.6, 0.8) + sim_shift, 4), "flags": flags,
                      "duration_s": r["audio_s"], "expected_s": 2.5, "lead_silence_s": 0.1,
                      "trail_silence_s": 0.2, "silence_share": 0.1, "clipped_share": 0.0,
                      "dc_offset": 0.0, "nonfinite": 0})
    with (path / "quality.jsonl").open("w", encoding="utf-8") as f:
        for c in clips:
            f.write(json.dumps(c) + "\n")
    rows = []
    for task, set_ in dict.fromkeys((c["task"], c["set"]) for c in clips):
        cs = [c for c in clips if (c["task"], c["set"]) == (task, set_)]
        wers, sims = [c["wer"] for c in cs], [c["sim"] for c in cs]
        flagged = [c for c in cs if c["flags"]]
        rows.append({"task": task, "set": set_, "n_clips": len(cs), "wer_mean": round(float(np.mean(wers)), 6),
                     "wer_corpus": round(float(np.mean(wers)) * 0.95, 6), "wer_n": len(cs),
                     "sim_mean": round(float(np.mean(sims)), 6), "sim_n": len(cs),
                     "sim_kind": "reference" if task == "clone" else "consistency",
                     "flagged_share": round(len(flagged) / len(cs), 6), "flagged_n": len(flagged),
                     "flag_counts": {k: sum(k in c["flags"] for c in cs)
                                     for k in sorted({f for c in cs for f in c["flags"]})},
                     "asr_backend": "whisper", "asr_model": "tiny", "sim_backend": "ecapa"})
    return rows


def _write_run_json(path: Path, label, groups, levels, mode, n) -> None:
    cmd = ["ttsbench", "run", "--url", "http://127.0.0.1:8091", "--task", ",".join(sorted({g[0] for g in groups})),
           "--set", ",".join(sorted({g[1] for g in groups})),
           "--concurrency" if mode == "concurrency" else "--rate", ",".join(lv[1:] for lv in levels),
           "--label", label]
    meta = {
        "version": 1, "ttsbench_version": "0.1.0", "command": cmd, "label": label,
        "url": "http://127.0.0.1:8091", "embedded_server": None,
        "server": {"models": {"object": "list", "data": [{"id": "Qwen3-TTS-12Hz-0.6B-CustomVoice",
                                                         "object": "model"}]},
                   "health": {"status": "ok"}},
        "config": {"tasks": sorted({g[0] for g in groups}), "sets": sorted({g[1] for g in groups}),
                   "concurrency": [int(lv[1:]) for lv in levels] if mode == "concurrency" else None,
                   "rates": [lv[1:] for lv in levels] if mode == "rate" else None,
                   "num_requests": n, "warmup": 1, "stream": True, "model": "Qwen3-TTS-12Hz-0.6B-CustomVoice",
                   "voice": "vivian", "language": "Auto", "max_new_tokens": 2048, "timeout": 300.0,
                   "seed": 0, "slo": SLO},
        "host": {"hostname": "ci-runner", "platform": "Linux-6.1-x86_64", "cpu_count": 2, "python": "3.11.7"},
        "packages": {"ttsbench": "0.1.0", "aiohttp": "3.9.5", "numpy": "1.26.4"},
        "started_at": "2025-11-21T10:00:00+00:00", "finished_at": "2025-11-21T10:05:00+00:00",
        "sessions": [{"started_at": "2025-11-21T10:00:00+00:00", "finished_at": "2025-11-21T10:05:00+00:00",
                      "command": cmd}],
    }
    (path / "run.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
