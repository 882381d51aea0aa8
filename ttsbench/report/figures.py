"""The catalogue of stored figures (docs/run-format.md): how each is labelled, formatted, and which way is
better. Reports label and colour changes with it; run directories are validated against it (every known
figure must be a number or null) and gate rules may name any of its numeric figures.
"""

from __future__ import annotations

# (key, label, format, better): summary row figures in reading order. format: int, f1/f2/f3, ms, pct, text,
# counts (an object of counts); better: "lower", "higher" or None.
_DIST = ("mean", "median", "p90", "p95", "p99", "max")
_DIST_METRICS = (("ttfab_ms", "TTFAB ms", "ms"), ("e2e_ms", "E2E ms", "ms"), ("rtf", "RTF", "f3"),
                 ("underrun_s", "underrun s", "f3"), ("max_gap_ms", "max chunk gap ms", "ms"))
SUMMARY_FIGURES: list[tuple[str, str, str, str | None]] = [
    ("completed", "completed", "int", "higher"),
    ("failed", "failed", "int", "lower"),
    ("duration_s", "duration s", "f2", None),
    ("request_throughput", "request throughput req/s", "f3", "higher"),
    ("audio_throughput", "audio throughput (audio s / s)", "f3", "higher"),
    ("frames_per_s", "frames / s", "f1", "higher"),
    ("total_audio_s", "total audio s", "f1", None),
    ("full_load_s", "full-load span s", "f2", None),
    ("full_load_audio_throughput", "full-load audio throughput (audio s / s)", "f3", "higher"),
    ("full_load_ttfab_ms_median", "full-load TTFAB ms median", "ms", "lower"),
    ("full_load_ttfab_ms_p95", "full-load TTFAB ms p95", "ms", "lower"),
    ("goodput", "goodput (share meeting SLO)", "pct", "higher"),
    ("starved", "starved requests (playback ran dry)", "int", "lower"),
    ("starved_at_chunk", "starved at chunk (index: requests)", "counts", None),
] + [(f"{m}_{d}", f"{label} {d}", fmt, "lower") for m, label, fmt in _DIST_METRICS for d in _DIST]

# WER is per word, or per character for Chinese, Japanese and Korean (CER), as each clip's `unit` says.
QUALITY_FIGURES: list[tuple[str, str, str, str | None]] = [
    ("n_clips", "clips", "int", None),
    ("wer_mean", "WER / CER mean", "pct", "lower"),
    ("wer_corpus", "WER / CER corpus", "pct", "lower"),
    ("wer_n", "WER clips scored", "int", None),
    ("sim_mean", "SIM mean", "f3", "higher"),
    ("sim_n", "SIM clips scored", "int", None),
    ("sim_kind", "SIM kind", "text", None),
    ("flagged_share", "flagged share", "pct", "lower"),
    ("flagged_n", "flagged clips", "int", "lower"),
    ("flag_counts", "flags by kind", "counts", None),
    ("asr_backend", "ASR backend", "text", None),
    ("asr_model", "ASR model", "text", None),
    ("sim_backend", "SIM backend", "text", None),
]

ROW_KEYS = {"task", "set", "level", "mode", "concurrency", "rate", "errors"}   # identify a row, not figures
QUALITY_KEYS = {"task", "set"}
NUMERIC_FORMATS = {"int", "f1", "f2", "f3", "ms", "pct"}
SUMMARY_NUMERIC = {k for k, _l, fmt, _b in SUMMARY_FIGURES if fmt in NUMERIC_FORMATS} | {"concurrency", "rate"}
QUALITY_NUMERIC = {k for k, _l, fmt, _b in QUALITY_FIGURES if fmt in NUMERIC_FORMATS}
