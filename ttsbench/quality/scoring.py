"""The quality step: score a run directory's saved audio into quality.jsonl and summary.json `quality`.

Per clip (every completed, non-warmup request): sanity checks, then an ASR transcript scored against the
input text, then a speaker embedding. Speaker similarity needs the whole set: clone clips are compared
with their reference clip, CustomVoice clips with the other clips of the same speaker (the cosine to the
mean embedding of the speaker's other clips, so each clip gets its own figure). VoiceDesign clips have
no reference voice and get none.

Both outputs are rewritten whole and atomically, so a crash never leaves half a file and the rest of
summary.json (the load figures) is kept as it was; clips scored before an interruption are kept in
quality.partial.jsonl and not scored again.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ttsbench.quality import normalize, sanity
from ttsbench.quality.audio import read_clip
from ttsbench.quality.errors import QualityError


@dataclass
class Options:
    asr: str = "whisper"           # whisper, faster-whisper or none
    asr_model: str = "base"
    sim: str = "auto"              # auto, ecapa, resemblyzer or none
    sim_model: Path | None = None  # ECAPA directory
    device: str = "auto"
    models_dir: Path | None = None
    limit: int | None = None       # clips per (task, set), the first ones in requests.jsonl
    expect_rate: int | None = None  # flag clips at any other sample rate


class Backends:
    """The loaded models; loading raises QualityError (what to install, where to put weights) before any clip."""

    def __init__(self, options: Options):
        from ttsbench.quality import asr, speaker

        self.asr = None if options.asr == "none" else asr.load_asr(
            options.asr, options.asr_model, options.device, options.models_dir)
        self.embedder = None if options.sim == "none" else speaker.load_embedder(
            options.sim, options.sim_model, options.device, options.models_dir)
        self.asr_model = options.asr_model if self.asr else None


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def select(records: list[dict], limit: int | None) -> list[dict]:
    """The clips to score: completed non-warmup requests, at most `limit` per (task, set)."""
    taken: dict[tuple, int] = defaultdict(int)
    out = []
    for r in records:
        if r.get("warmup") or not r.get("ok"):
            continue
        key = (r.get("task"), r.get("set"))
        if limit is not None and taken[key] >= limit:
            continue
        taken[key] += 1
        out.append(r)
    return out


def resolve_ref_audio(value: str, run_dir: Path) -> Path:
    """A reference clip path as stored: absolute, relative to datasets/, or relative to the run directory."""
    from ttsbench.datasets import datasets_dir

    path = Path(value).expanduser()
    if path.is_absolute():
        return path
    for base in (datasets_dir(), run_dir):
        if (base / path).is_file():
            return base / path
    return datasets_dir() / path


def _check_references(records: list[dict], run_dir: Path) -> None:
    """Clone references must be there before hours of ASR, not found missing after them."""
    missing = sorted({r["ref_audio_path"] for r in records if r.get("task") == "clone" and r.get("ref_audio_path")
                      and not resolve_ref_audio(r["ref_audio_path"], run_dir).is_file()})
    if missing:
        from ttsbench.datasets import datasets_dir

        raise QualityError(f"reference clips not found: {', '.join(missing)} (looked in {datasets_dir()} "
                           f"and {run_dir}; set TTSBENCH_DATASETS, or score with --sim none)")


PARTIAL = "quality.partial.jsonl"


def _read_partial(path: Path, header: dict) -> dict[str, tuple[dict, np.ndarray | None]]:
    """Clips already scored by an interrupted step with the same backends: id -> (row, embedding)."""
    if not path.exists():
        return {}
    done = {}
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f):
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue  # the line a crash cut short
            if lineno == 0 and entry.get("header") != header:
                return {}  # scored with other backends or options: start over
            if "row" in entry:
                emb = entry["embedding"]
                done[entry["row"]["id"]] = (entry["row"], None if emb is None else np.asarray(emb, np.float32))
    return done


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return True
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _score_clip(record: dict, run_dir: Path, backends: Backends, options: Options):
    """(quality record, speaker embedding or None) for one request."""
    text = record.get("text") or ""
    row = {"id": record["id"], "task": record.get("task"), "set": record.get("set"),
           "level": record.get("level"), "language": record.get("language"), "voice": record.get("voice")}
    empty = {"asr_text": None, "ref_text_norm": None, "hyp_text_norm": None, "wer": None, "unit": None,
             "ref_units": None, "errors": None, "sim": None}
    audio_path = record.get("audio_path")
    if not audio_path:
        return {**row, **empty, "flags": ["missing_audio: the run saved no audio (--no-save-audio?)"]}, None
    try:
        clip = read_clip(run_dir / audio_path)
    except Exception as exc:  # soundfile raises its own LibsndfileError and OSError subclasses
        return {**row, **empty, "flags": [f"unreadable: {audio_path}: {exc}"]}, None

    checks = sanity.check(clip, text, record.get("sample_rate"), options.expect_rate)
    flags = checks.pop("flags")
    row.update(empty)
    audio_16k = clip.at() if (backends.asr or backends.embedder) and len(clip.samples) else None
    if backends.asr:
        hyp = backends.asr.transcribe(audio_16k, record.get("language")) if audio_16k is not None else ""
        s = normalize.score(text, hyp)
        row.update(asr_text=hyp, ref_text_norm=s.ref_norm, hyp_text_norm=s.hyp_norm, wer=s.wer, unit=s.unit,
                   ref_units=s.ref_units, errors=s.errors)
    embedding = backends.embedder.embed(audio_16k) if backends.embedder and audio_16k is not None else None
    return {**row, **checks, "flags": flags}, embedding


def _similarities(rows: list[dict], embeddings: list, records: list[dict], run_dir: Path,
                  backends: Backends) -> None:
    """Fill `sim` and `sim_kind`: clone vs its reference clip, custom vs the same speaker's other clips."""
    from ttsbench.quality.speaker import cosine

    ref_cache: dict[Path, np.ndarray | None] = {}
    by_voice: dict[tuple, list[int]] = defaultdict(list)
    for i, (row, emb, rec) in enumerate(zip(rows, embeddings, records, strict=True)):
        if rec.get("task") == "clone":
            row["sim_kind"] = "reference"
            ref = rec.get("ref_audio_path")
            if emb is None or not ref:
                continue
            path = resolve_ref_audio(ref, run_dir)
            if path not in ref_cache:
                try:
                    ref_cache[path] = backends.embedder.embed(read_clip(path).at())
                except Exception as exc:
                    raise QualityError(f"cannot read the reference clip {ref} of {rec['id']} ({exc})") from exc
            if ref_cache[path] is not None:
                row["sim"] = round(cosine(emb, ref_cache[path]), 4)
        elif rec.get("task") == "custom":
            row["sim_kind"] = "consistency"
            if emb is not None and rec.get("voice"):
                by_voice[(rec.get("set"), rec["voice"].lower())].append(i)
        else:
            row["sim_kind"] = None
    for members in by_voice.values():
        if len(members) < 2:
            continue
        stack = np.stack([embeddings[i] / np.linalg.norm(embeddings[i]) for i in members])
        total = stack.sum(axis=0)
        for k, i in enumerate(members):
            rows[i]["sim"] = round(cosine(stack[k], total - stack[k]), 4)


def _mean(values: list[float]) -> float | None:
    return round(float(np.mean(values)), 4) if values else None


def _figures(members: list[dict]) -> dict:
    """WER (mean of utterances, corpus), SIM and flagged share of some clips, each with its count."""
    scored = [r for r in members if r.get("wer") is not None]
    sims = [r["sim"] for r in members if r.get("sim") is not None]
    corpus = normalize.corpus_wer([(r["errors"], r["ref_units"]) for r in scored])
    return {
        "wer_mean": _mean([r["wer"] for r in scored]),
        "wer_corpus": round(corpus, 4) if corpus is not None else None,
        "wer_n": len(scored),
        "sim_mean": _mean(sims), "sim_n": len(sims),
        "flagged_share": round(sum(1 for r in members if r["flags"]) / len(members), 4),
        "flagged_n": len(members),
    }


def _by(members: list[dict], key: str) -> dict:
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in members:
        groups[str(r.get(key))].append(r)
    return {name: _figures(group) for name, group in groups.items()}


def aggregate(rows: list[dict], asr_backend: str | None, asr_model: str | None,
              sim_backend: str | None) -> list[dict]:
    """summary.json `quality` rows, one per (task, set), recomputed from quality.jsonl records.

    Besides the set's figures: `flag_counts` (clips per flag kind), and the same figures `by_language`
    (a multilingual set mixes WER and CER, which papers report apart) and `by_level` (quality under load:
    a batching bug shows at high concurrency only)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        groups[(row["task"], row["set"])].append(row)
    out = []
    for (task, set_), members in groups.items():
        kinds: dict[str, int] = defaultdict(int)
        for r in members:
            for kind in {sanity.flag_kind(f) for f in r["flags"]}:
                kinds[kind] += 1
        out.append({
            "task": task, "set": set_, "n_clips": len(members), **_figures(members),
            "sim_kind": next((r.get("sim_kind") for r in members if r.get("sim_kind")), None),
            "flag_counts": dict(sorted(kinds.items())),
            "asr_backend": asr_backend, "asr_model": asr_model, "sim_backend": sim_backend,
            "by_language": _by(members, "language"), "by_level": _by(members, "level"),
        })
    return out


def score_run(run_dir: Path, options: Options, progress: Callable[[int, int], None] | None = None) -> list[dict]:
    """Score a run directory; writes quality.jsonl and the `quality` rows of summary.json, returns the rows."""
    from ttsbench.storage import RunDir

    try:
        run = RunDir.open(run_dir)
    except FileNotFoundError as exc:
        raise QualityError(str(exc)) from exc
    records = select(run.records(), options.limit)
    if not records:
        raise QualityError(f"{run_dir} has no completed requests to score")
    if options.sim != "none":
        _check_references(records, run.path)
    backends = Backends(options)

    # Clips scored so far go to quality.partial.jsonl as they are done, so an interrupted step (hours of
    # large-v3) continues where it stopped when run again with the same backends.
    header = {"asr": backends.asr.backend if backends.asr else None, "asr_model": backends.asr_model,
              "sim": backends.embedder.backend if backends.embedder else None,
              "sim_model": str(options.sim_model) if options.sim_model else None, "expect_rate": options.expect_rate}
    partial = run.path / PARTIAL
    done = _read_partial(partial, header)
    rows, embeddings = [], []
    with partial.open("a" if done else "w", encoding="utf-8") as f:
        if not done:
            f.write(json.dumps({"header": header}) + "\n")
        elif not _ends_with_newline(partial):
            f.write("\n")  # a crash cut the last line short
        for i, record in enumerate(records):
            if record["id"] in done:
                row, emb = done[record["id"]]
            else:
                row, emb = _score_clip(record, run.path, backends, options)
                f.write(json.dumps({"row": row, "embedding": None if emb is None else emb.tolist()},
                                   ensure_ascii=False) + "\n")
                f.flush()
            rows.append(row)
            embeddings.append(emb)
            if progress:
                progress(i + 1, len(records))
    if backends.embedder:
        _similarities(rows, embeddings, records, run.path, backends)
    else:
        for row in rows:
            row["sim_kind"] = None

    quality = aggregate(rows, backends.asr.backend if backends.asr else None, backends.asr_model,
                        backends.embedder.backend if backends.embedder else None)
    _write_atomic(run.path / "quality.jsonl",
                  "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    summary_path = run.path / "summary.json"
    summary = json.loads(summary_path.read_text(encoding="utf-8")) if summary_path.exists() else {"version": 1}
    summary["quality"] = quality
    _write_atomic(summary_path, json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    partial.unlink()
    return quality
