"""Reading a run directory (docs/run-format.md) for reports, baselines and gates.

Reports and gates read only the stored files, never a live server, so every complaint about a
missing or malformed file is raised here as RunDirError with the path and what is wrong; the
CLI turns that into exit status 2 ("unusable input") instead of a traceback.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ttsbench.report.figures import QUALITY_NUMERIC, SUMMARY_NUMERIC


class RunDirError(ValueError):
    """A run directory, summary or baseline file that cannot be used."""


_LEVEL = re.compile(r"^(c)(\d+)$|^(r)(inf|\d+(?:\.\d+)?)$")


def level_key(level: str) -> tuple[str, float]:
    """Sort key for load levels: c1 < c2 < c16, r0.5 < r2 < rinf; unknown shapes sort last by name."""
    m = _LEVEL.match(level)
    if not m:
        return ("z", math.inf)
    if m.group(1):
        return ("c", float(m.group(2)))
    return ("r", math.inf if m.group(4) == "inf" else float(m.group(4)))


def level_mode(level: str) -> str:
    """`concurrency` or `rate` for a level name (what its plots put on the x axis)."""
    return "rate" if level_key(level)[0] == "r" else "concurrency"


def read_json(path: Path, what: str) -> dict:
    """A JSON object from `path`, or RunDirError naming `what` it was meant to be."""
    if not path.is_file():
        raise RunDirError(f"{what} not found: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RunDirError(f"{what} is not valid JSON: {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise RunDirError(f"{what} must hold a JSON object: {path}")
    return data


def read_jsonl(path: Path) -> tuple[list[dict], int]:
    """The objects of a JSON-lines file and how many lines were unreadable.

    A run that crashed can leave a half-written last line; it is counted (and shown in the
    report) rather than making the whole run unreadable.
    """
    records, bad = [], 0
    if not path.is_file():
        return records, bad
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                bad += 1
                continue
            if isinstance(obj, dict):
                records.append(obj)
            else:
                bad += 1
    return records, bad


def validate_summary(summary: dict, source: Path) -> dict:
    """Check the shape of summary.json (or a baseline's copy of it) and return it.

    Known figures are checked to be numbers or null, so a gate never compares strings by accident.
    """
    rows = summary.get("rows")
    if not isinstance(rows, list):
        raise RunDirError(f"{source}: 'rows' must be a list of summary rows")
    seen = set()
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise RunDirError(f"{source}: rows[{i}] is not an object")
        for key in ("task", "set", "level"):
            if not isinstance(row.get(key), str) or not row[key]:
                raise RunDirError(f"{source}: rows[{i}] has no '{key}'")
        ident = (row["task"], row["set"], row["level"])
        if ident in seen:
            raise RunDirError(f"{source}: rows[{i}] repeats {'/'.join(ident)}")
        seen.add(ident)
        _check_numbers(row, f"{source}: rows[{i}] ({'/'.join(ident)})", SUMMARY_NUMERIC)
        for key in ("errors", "starved_at_chunk"):
            if not isinstance(row.get(key, {}), (dict, type(None))):
                raise RunDirError(f"{source}: rows[{i}] '{key}' must be an object of counts")
    quality = summary.get("quality", [])
    if quality is None:
        quality = summary["quality"] = []
    if not isinstance(quality, list):
        raise RunDirError(f"{source}: 'quality' must be a list")
    for i, q in enumerate(quality):
        if not isinstance(q, dict) or not isinstance(q.get("task"), str) or not isinstance(q.get("set"), str):
            raise RunDirError(f"{source}: quality[{i}] needs 'task' and 'set'")
        _check_numbers(q, f"{source}: quality[{i}] ({q['task']}/{q['set']})", QUALITY_NUMERIC)
    return summary


def _check_numbers(obj: dict, where: str, numeric: set[str]) -> None:
    """Known figures must be numbers or null; fields added by later versions are kept as they are."""
    for key in numeric & set(obj):
        value = obj[key]
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise RunDirError(f"{where}: '{key}' must be a number or null, got {value!r}")


@dataclass
class Run:
    """One run directory as stored: the configuration, per-request records and aggregates."""
    path: Path
    label: str
    meta: dict
    summary: dict
    requests: list[dict] = field(default_factory=list)
    quality_clips: list[dict] = field(default_factory=list)
    bad_lines: int = 0

    @property
    def rows(self) -> list[dict]:
        return self.summary.get("rows", [])

    @property
    def quality(self) -> list[dict]:
        return self.summary.get("quality") or []

    def measured(self) -> list[dict]:
        """Non-warmup request records (what every aggregate is computed from)."""
        return [r for r in self.requests if not r.get("warmup")]


BASELINE_KIND = "ttsbench-baseline"


def load_run(path: str | Path, with_requests: bool = True) -> Run:
    """Read a run directory (summary.json is required: `ttsbench summarize` writes it), or a
    baseline JSON written by `ttsbench baseline` (its figures only, no per-request records)."""
    path = Path(path)
    if path.is_file():
        return _load_baseline(path)
    if not path.is_dir():
        raise RunDirError(f"run directory not found: {path}")
    meta = read_json(path / "run.json", "run.json")
    summary_path = path / "summary.json"
    if not summary_path.is_file():
        raise RunDirError(f"summary.json not found in {path}: run `ttsbench summarize {path}` first")
    summary = validate_summary(read_json(summary_path, "summary.json"), summary_path)
    run = Run(path=path, label=str(meta.get("label") or path.name), meta=meta, summary=summary)
    if with_requests:
        run.requests, bad = read_jsonl(path / "requests.jsonl")
        run.quality_clips, bad_q = read_jsonl(path / "quality.jsonl")
        run.bad_lines = bad + bad_q
    return run


def _load_baseline(path: Path) -> Run:
    doc = read_json(path, "baseline")
    if doc.get("kind") != BASELINE_KIND:
        raise RunDirError(f"{path}: not a ttsbench baseline (kind {doc.get('kind')!r}); give a run directory "
                          "or a file written by `ttsbench baseline`")
    validate_summary(doc, path)
    meta = doc.get("source") if isinstance(doc.get("source"), dict) else {}
    summary = {"slo": doc.get("slo"), "rows": doc["rows"], "quality": doc.get("quality") or []}
    return Run(path=path, label=f"baseline {meta.get('label') or path.stem}", meta=meta, summary=summary)


def unique_labels(runs: list[Run]) -> None:
    """Give runs distinct labels (plots and tables are keyed by them)."""
    seen: dict[str, int] = {}
    for run in runs:
        n = seen.get(run.label, 0)
        seen[run.label] = n + 1
        if n:
            run.label = f"{run.label} #{n + 1}"
