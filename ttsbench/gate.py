"""Regression gates: a run's figures against a stored baseline, with tolerances from a rules file.

`ttsbench baseline` freezes a run's summary rows (plus where they came from) into one JSON file that
can be committed; `ttsbench gate` compares a new run with it. Every rule is checked on every
(task, set, level) and the verdict lists each check, so a CI log says exactly which figure moved by
how much. Levels measured on only one side are listed, never skipped silently.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from ttsbench import __version__
from ttsbench.report.rundir import BASELINE_KIND, RunDirError, load_run
from ttsbench.report.figures import QUALITY_NUMERIC, SUMMARY_NUMERIC

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

_LIMIT_KEYS = ("max_rise_pct", "max_fall_pct", "max_rise", "max_fall", "max", "min")
_RULE_KEYS = {"metric", "tasks", "sets", "levels", "relative_to_level", "why", *_LIMIT_KEYS}


class RulesError(ValueError):
    """A rules file that cannot be used (exit status 2, like other unusable input)."""


@dataclass(frozen=True)
class Rule:
    metric: str
    max_rise_pct: float | None = None
    max_fall_pct: float | None = None
    max_rise: float | None = None
    max_fall: float | None = None
    max: float | None = None
    min: float | None = None
    tasks: tuple[str, ...] | None = None
    sets: tuple[str, ...] | None = None
    levels: tuple[str, ...] | None = None
    relative_to_level: str | None = None
    why: str | None = None

    @property
    def needs_baseline(self) -> bool:
        return any(v is not None for v in (self.max_rise_pct, self.max_fall_pct, self.max_rise, self.max_fall))

    def applies(self, task: str, set_: str, level: str | None) -> bool:
        return ((self.tasks is None or task in self.tasks) and (self.sets is None or set_ in self.sets)
                and (self.levels is None or level is None or level in self.levels))

    def describe(self) -> str:
        parts = []
        if self.max_rise_pct is not None or self.max_rise is not None:
            parts.append("rise ≤ " + " or ".join(
                t for t in (_pct(self.max_rise_pct), _num(self.max_rise)) if t))
        if self.max_fall_pct is not None or self.max_fall is not None:
            parts.append("fall ≤ " + " or ".join(
                t for t in (_pct(self.max_fall_pct), _num(self.max_fall)) if t))
        if self.max is not None:
            parts.append(f"≤ {_num(self.max)}")
        if self.min is not None:
            parts.append(f"≥ {_num(self.min)}")
        name = f"{self.metric} ÷ {self.relative_to_level}" if self.relative_to_level else self.metric
        return f"{name} " + ", ".join(parts)

    def bounds(self, base: float | None) -> tuple[float, float]:
        """(lowest, highest) allowed current value given the baseline value."""
        lo, hi = -math.inf, math.inf
        if base is not None:
            rises = [abs(base) * self.max_rise_pct / 100 if self.max_rise_pct is not None else None, self.max_rise]
            rises = [r for r in rises if r is not None]
            if rises:
                hi = base + max(rises)
            falls = [abs(base) * self.max_fall_pct / 100 if self.max_fall_pct is not None else None, self.max_fall]
            falls = [f for f in falls if f is not None]
            if falls:
                lo = base - max(falls)
        if self.max is not None:
            hi = min(hi, self.max)
        if self.min is not None:
            lo = max(lo, self.min)
        return lo, hi


def _pct(v) -> str:
    return "" if v is None else f"{v:g}%"


def _num(v) -> str:
    return "" if v is None else f"{v:g}"


@dataclass
class Rules:
    rules: list[Rule]
    missing_levels: str = "fail"
    source: str = "default rules"


def default_rules_text() -> str:
    return resources.files("ttsbench").joinpath("gate_rules.toml").read_text(encoding="utf-8")


def load_rules(path: str | Path | None = None) -> Rules:
    """Rules from a TOML file (or the packaged defaults); RulesError says what is wrong and where."""
    if path is None:
        text, source = default_rules_text(), "default rules"
    else:
        path = Path(path)
        if not path.is_file():
            raise RulesError(f"rules file not found: {path}")
        text, source = path.read_text(encoding="utf-8"), str(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RulesError(f"{source}: not valid TOML: {exc}") from exc
    unknown = set(data) - {"rule", "missing_levels"}
    if unknown:
        raise RulesError(f"{source}: unknown top-level key(s) {sorted(unknown)}; expected [[rule]] tables "
                         "and missing_levels")
    missing = data.get("missing_levels", "fail")
    if missing not in ("fail", "report"):
        raise RulesError(f"{source}: missing_levels must be \"fail\" or \"report\", not {missing!r}")
    raw = data.get("rule", [])
    if not isinstance(raw, list) or not raw:
        raise RulesError(f"{source}: no [[rule]] tables")
    return Rules([_parse_rule(r, i, source) for i, r in enumerate(raw)], missing, source)


def _parse_rule(raw: dict, i: int, source: str) -> Rule:
    where = f"{source}: rule {i + 1}"
    if not isinstance(raw, dict):
        raise RulesError(f"{where}: must be a table")
    unknown = set(raw) - _RULE_KEYS
    if unknown:
        raise RulesError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_RULE_KEYS)}")
    metric = raw.get("metric")
    if not isinstance(metric, str) or not metric:
        raise RulesError(f"{where}: needs metric = \"<summary figure>\", e.g. \"ttfab_ms_p95\"")
    where = f"{where} ({metric})"
    kw: dict = {"metric": metric}
    for key in _LIMIT_KEYS:
        if key in raw:
            v = raw[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise RulesError(f"{where}: {key} must be a number, not {v!r}")
            if key not in ("max", "min") and v < 0:
                raise RulesError(f"{where}: {key} must be >= 0")
            kw[key] = float(v)
    if not any(k in kw for k in _LIMIT_KEYS):
        raise RulesError(f"{where}: gives no limit; use one of {', '.join(_LIMIT_KEYS)}")
    for key in ("tasks", "sets", "levels"):
        if key in raw:
            v = raw[key]
            if not isinstance(v, list) or not v or not all(isinstance(x, str) for x in v):
                raise RulesError(f"{where}: {key} must be a non-empty list of names")
            kw[key] = tuple(v)
    if "relative_to_level" in raw:
        ref = raw["relative_to_level"]
        if not isinstance(ref, str) or not ref:
            raise RulesError(f"{where}: relative_to_level must be a level name such as \"c1\"")
        if metric in QUALITY_NUMERIC:
            raise RulesError(f"{where}: relative_to_level applies to per-level figures, not quality figures")
        kw["relative_to_level"] = ref
    if "why" in raw:
        kw["why"] = str(raw["why"])
    return Rule(**kw)


@dataclass
class Figures:
    """What a gate compares: summary rows and quality rows, with where they came from."""
    rows: dict[tuple[str, str, str], dict]
    quality: dict[tuple[str, str], dict]
    source: dict
    slo: dict | None = None
    path: str = ""


def load_figures(path: str | Path) -> Figures:
    """The figures of a run directory or of a baseline JSON written by `ttsbench baseline`."""
    run = load_run(path, with_requests=False)
    source = _source(run.path, run.meta) if run.path.is_dir() else run.meta
    return Figures(_index_rows(run.rows), _index_quality(run.quality), source, run.summary.get("slo"), str(path))


def _index_rows(rows: list[dict]) -> dict:
    return {(r["task"], r["set"], r["level"]): r for r in rows}


def _index_quality(rows: list[dict]) -> dict:
    return {(q["task"], q["set"]): q for q in rows}


def _source(path: Path, meta: dict) -> dict:
    return {"run_dir": str(path), "label": meta.get("label"), "started_at": meta.get("started_at"),
            "finished_at": meta.get("finished_at"), "ttsbench_version": meta.get("ttsbench_version"),
            "command": meta.get("command"), "url": meta.get("url"), "server": meta.get("server"),
            "embedded_server": meta.get("embedded_server"), "host": meta.get("host"),
            "packages": meta.get("packages"), "config": meta.get("config")}


def make_baseline(run_dir: str | Path) -> dict:
    """The baseline document of a run: every summary figure plus the run's provenance."""
    if not Path(run_dir).is_dir():
        raise RunDirError(f"run directory not found: {run_dir}")
    run = load_run(run_dir, with_requests=False)
    if not run.rows:
        raise RunDirError(f"{run_dir}: summary.json has no rows; nothing to keep as a baseline")
    return {"kind": BASELINE_KIND, "version": 1, "created_at": dt.datetime.now(dt.timezone.utc).isoformat(
        timespec="seconds"), "created_by": f"ttsbench {__version__}", "source": _source(run.path, run.meta),
        "slo": run.summary.get("slo"), "rows": run.rows, "quality": run.quality}


def write_baseline(run_dir: str | Path, out: str | Path) -> Path:
    doc = make_baseline(run_dir)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(out)
    return out


@dataclass
class Check:
    """One line of the verdict."""
    what: str                  # rule description, or "coverage" for missing levels
    where: str                 # task/set/level
    baseline: float | None
    current: float | None
    limit: str
    status: str                # pass | FAIL | missing | not scored
    note: str = ""

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"


@dataclass
class Verdict:
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def failures(self) -> int:
        return sum(c.failed for c in self.checks)

    @property
    def ok(self) -> bool:
        return self.failures == 0


def compare(base: Figures, cur: Figures, rules: Rules) -> Verdict:
    """Check every rule on every key measured on both sides; list keys measured on only one."""
    _check_metrics_known(rules, base, cur)
    verdict = Verdict()
    if base.slo and cur.slo and base.slo != cur.slo:
        verdict.notes.append(f"the SLO differs (baseline {base.slo}, current {cur.slo}): goodput is not comparable")
    verdict.notes += _config_differences(base.source, cur.source)
    missing_status = "FAIL" if rules.missing_levels == "fail" else "missing"
    for key in sorted(set(base.rows) | set(cur.rows)):
        if key in base.rows and key in cur.rows:
            continue
        side = "current run" if key in base.rows else "baseline"
        verdict.checks.append(Check("coverage", "/".join(key), None, None, "measured on both sides",
                                    missing_status, f"not in the {side}"))
    for rule in rules.rules:
        if _is_quality(rule.metric, base, cur):
            _quality_checks(rule, base, cur, missing_status, verdict)
            continue
        before = len(verdict.checks)
        for key in sorted(set(base.rows) & set(cur.rows)):
            if not rule.applies(*key) or key[2] == rule.relative_to_level:
                continue
            if rule.relative_to_level:
                ref = (key[0], key[1], rule.relative_to_level)
                missing = [side for side, f in (("baseline", base), ("current run", cur)) if ref not in f.rows]
                if missing:
                    verdict.checks.append(Check(rule.describe(), "/".join(key), None, None, "", "FAIL",
                                                f"no {rule.relative_to_level} in the {' and '.join(missing)}"))
                    continue
                verdict.checks.append(_check(rule, "/".join(key), _ratio(base.rows[key], base.rows[ref], rule.metric),
                                             _ratio(cur.rows[key], cur.rows[ref], rule.metric)))
            else:
                verdict.checks.append(_check(rule, "/".join(key), base.rows[key].get(rule.metric),
                                             cur.rows[key].get(rule.metric)))
        if len(verdict.checks) == before:   # e.g. levels = ["c16"] when c16 was not measured
            scope = ", ".join(f"{k}={'/'.join(v)}" for k, v in (("tasks", rule.tasks), ("sets", rule.sets),
                                                               ("levels", rule.levels)) if v) or "all"
            verdict.checks.append(Check(rule.describe(), scope, None, None, "", missing_status,
                                        "checked nothing: no level measured on both sides matches"))
    return verdict


def verdict_json(verdict: Verdict, base: Figures, cur: Figures, rules: Rules) -> dict:
    """The verdict for machines (CI dashboards, bots): every check with its values and status."""
    return {"ok": verdict.ok, "failures": verdict.failures, "baseline": base.path, "current": cur.path,
            "rules": rules.source, "missing_levels": rules.missing_levels, "notes": verdict.notes,
            "checks": [{"rule": c.what, "where": c.where, "baseline": c.baseline, "current": c.current,
                        "limit": c.limit, "status": c.status, "note": c.note} for c in verdict.checks]}


_IRRELEVANT_OPTIONS = {"label", "save_audio", "datasets", "out", "resume"}


def _config_differences(base: dict, cur: dict) -> list[str]:
    """Run options that differ: figures measured under other options may differ for that reason alone."""
    bc, cc = base.get("config") or {}, cur.get("config") or {}
    notes = [f"option {k} differs: baseline {bc[k]!r}, current {cc[k]!r}"
             for k in sorted(set(bc) & set(cc) - _IRRELEVANT_OPTIONS) if bc[k] != cc[k]]
    models = [(side.get("embedded_server") or {}).get("model") for side in (base, cur)]
    if models[0] != models[1]:
        notes.append(f"embedded server model differs: baseline {models[0]!r}, current {models[1]!r}")
    return notes


def _ratio(row: dict, ref: dict, metric: str) -> float | None:
    """A figure relative to the same figure at the reference level: machine speed cancels out."""
    a, b = row.get(metric), ref.get(metric)
    return None if a is None or not b else a / b


def _quality_checks(rule: Rule, base: Figures, cur: Figures, missing_status: str, verdict: Verdict) -> None:
    keys = [k for k in sorted(set(base.quality) | set(cur.quality)) if rule.applies(*k, None)]
    if not keys:
        verdict.checks.append(Check(rule.describe(), "all", None, None, "", "not scored",
                                    "no quality rows on either side"))
        return
    for key in keys:
        if key not in base.quality or key not in cur.quality:
            side = "current run" if key in base.quality else "baseline"
            verdict.checks.append(Check(rule.describe(), "/".join(key), None, None, "", missing_status,
                                        f"quality not scored in the {side}"))
            continue
        verdict.checks.append(_check(rule, "/".join(key), base.quality[key].get(rule.metric),
                                     cur.quality[key].get(rule.metric)))


def _check(rule: Rule, where: str, base, cur) -> Check:
    what = rule.describe()
    if cur is None and base is None:
        return Check(what, where, base, cur, "", "pass", "no value on either side")
    if cur is None or (base is None and rule.needs_baseline):
        side = "current run" if cur is None else "baseline"
        return Check(what, where, base, cur, "", "FAIL", f"no value in the {side} (no request completed?)")
    lo, hi = rule.bounds(base)
    limit = " and ".join(t for t in (f"≥ {_fmt(lo)}" if lo > -math.inf else "",
                                     f"≤ {_fmt(hi)}" if hi < math.inf else "") if t)
    ok = lo - 1e-12 <= cur <= hi + 1e-12
    return Check(what, where, base, cur, limit, "pass" if ok else "FAIL", "" if ok else (rule.why or ""))


def _values(metric: str, figures: tuple[Figures, ...], quality: bool) -> list:
    return [r[metric] for f in figures for r in (f.quality if quality else f.rows).values() if metric in r]


def _is_quality(metric: str, base: Figures, cur: Figures) -> bool:
    """Quality figures are per (task, set); a figure unknown to this version counts as one if only
    quality rows carry it."""
    return metric in QUALITY_NUMERIC or (metric not in SUMMARY_NUMERIC and not _values(metric, (base, cur), False)
                                         and bool(_values(metric, (base, cur), True)))


def _check_metrics_known(rules: Rules, base: Figures, cur: Figures) -> None:
    """Every rule names a numeric figure: a known one, or one the compared files carry."""
    for rule in rules.rules:
        values = _values(rule.metric, (base, cur), _is_quality(rule.metric, base, cur))
        if rule.metric not in SUMMARY_NUMERIC | QUALITY_NUMERIC and not values:
            raise RulesError(f"{rules.source}: unknown metric {rule.metric!r}: not a summary figure "
                             "(e.g. ttfab_ms_p95, e2e_ms_p99, audio_throughput, failed, wer_mean)")
        bad = [v for v in values if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)))]
        if bad:
            raise RulesError(f"{rules.source}: metric {rule.metric!r} is not a number (e.g. {bad[0]!r}); "
                             "rules compare numeric figures")


def _fmt(v) -> str:
    if v is None:
        return "–"
    if v == 0 or (float(v).is_integer() and abs(v) >= 1):
        return f"{v:,.0f}"
    return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.4g}"


def change_text(base, cur) -> str:
    if base is None or cur is None:
        return ""
    if cur == base:
        return "±0"
    if base == 0:
        return f"{cur - base:+.4g}"
    return f"{100 * (cur - base) / abs(base):+.1f}%"


def print_verdict(verdict: Verdict, base: Figures, cur: Figures, rules: Rules, console) -> None:
    """The verdict as a rich table: each rule with baseline, current, limit and result."""
    from rich.table import Table

    table = Table(title=f"ttsbench gate: {cur.path} against {base.path} ({rules.source})", title_justify="left")
    for col, just in (("rule", "left"), ("task/set/level", "left"), ("baseline", "right"), ("current", "right"),
                      ("change", "right"), ("limit", "left"), ("result", "left")):
        table.add_column(col, justify=just, overflow="fold")
    style = {"pass": "green", "FAIL": "bold red", "missing": "yellow", "not scored": "dim"}
    for c in verdict.checks:
        result = f"[{style[c.status]}]{c.status}[/]" + (f" {c.note}" if c.note else "")
        table.add_row(c.what, c.where, _fmt(c.baseline), _fmt(c.current), change_text(c.baseline, c.current),
                      c.limit, result)
    console.print(table)
    src = base.source or {}
    console.print(f"baseline: {src.get('label') or src.get('run_dir') or base.path}"
                  f" started {src.get('started_at') or '?'}", highlight=False)
    for note in verdict.notes:
        console.print(f"[yellow]note:[/] {note}")
    n = len([c for c in verdict.checks if c.status in ("pass", "FAIL")])
    if verdict.ok:
        console.print(f"[green]PASS[/]: {n} checks, none failed")
    else:
        console.print(f"[bold red]FAIL[/]: {verdict.failures} of {len(verdict.checks)} checks failed")
        for c in (c for c in verdict.checks if c.failed):   # again, short, for long tables in CI logs
            values = f": {_fmt(c.baseline)} -> {_fmt(c.current)} (limit {c.limit})" if c.limit else ""
            console.print(f"  {c.where}: {c.what}{values}{' ' + c.note if c.note else ''}", highlight=False)
