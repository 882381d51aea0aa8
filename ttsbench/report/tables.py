"""HTML tables for the report, built with pandas: every figure by level, runs side by side.

With several runs each later run's cell carries its change relative to the first run, coloured by
whether the change is better or worse for that figure (lower latency is better, higher throughput
is better), so a reader sees regressions without doing arithmetic.
"""

from __future__ import annotations

import json
import math
import shlex
from html import escape

import pandas as pd

from ttsbench.report.figures import QUALITY_FIGURES, QUALITY_KEYS, ROW_KEYS, SUMMARY_FIGURES
from ttsbench.report.rundir import Run, level_key

def fmt_value(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, dict):
        return escape(", ".join(f"{k}: {v}" for k, v in value.items())) or "none"
    if isinstance(value, list):
        return escape(", ".join(map(str, value)))
    if fmt == "text" or isinstance(value, str):
        return escape(str(value))
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if fmt == "int":
        return f"{value:,.0f}"
    if fmt == "pct":
        return f"{100 * value:.2f}%"
    if fmt == "ms":
        return f"{value:,.1f}"
    digits = {"f1": 1, "f2": 2, "f3": 3}.get(fmt, 4)
    return f"{value:,.{digits}f}"


def change_html(base, cur, better: str | None) -> str:
    """'(+12.3%)' coloured by direction; empty when either side is not a number."""
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (base, cur)):
        return ""
    if base == 0:
        if cur == 0:
            return ""
        rel_text, worse = "(was 0)", (better == "lower") == (cur > 0)
    else:
        rel = (cur - base) / abs(base)
        if abs(rel) < 0.005:
            return ' <span class="chg">(±0%)</span>'
        rel_text, worse = f"({100 * rel:+.1f}%)", (better == "lower") == (rel > 0)
    cls = "chg" if better is None else ("chg worse" if worse else "chg better")
    return f' <span class="{cls}">{rel_text}</span>'


def extra_figures(rows: list[dict], known: list[tuple], skip: set[str]) -> list[tuple]:
    """Numeric figures present in the rows but not in the known list, so nothing stored is hidden."""
    names = {k for k, *_ in known}
    extra = []
    for row in rows:
        for key, value in row.items():
            if key in names or key in skip or key in {e[0] for e in extra}:
                continue
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            extra.append((key, key, "f3" if numeric else "text", None))
    return extra


def figure_table(figures: list[tuple], groups: list[tuple[str, list[dict | None]]],
                 run_labels: list[str], errors_row: bool = False) -> str:
    """Figures down the side; one column per group (level, or task/set), runs side by side within it.

    `groups` holds, per column group, each run's row (None when that run has no such row).
    """
    multi = len(run_labels) > 1
    columns, data = [], {}
    for group, per_run in groups:
        for i, row in enumerate(per_run):
            col = (escape(group), escape(run_labels[i])) if multi else escape(group)
            columns.append(col)
            cells = []
            for key, _label, fmt, better in figures:
                if row is None:
                    cells.append('<span class="missing">not run</span>')
                    continue
                cell = fmt_value(row.get(key), fmt)
                if i > 0 and per_run[0] is not None:
                    cell += change_html(per_run[0].get(key), row.get(key), better)
                cells.append(cell)
            if errors_row:
                cells.append("–" if row is None else errors_text(row.get("errors")))
            data[col] = cells
    index = [escape(label) for _k, label, *_ in figures] + (["errors by kind"] if errors_row else [])
    df = pd.DataFrame(data, index=index, columns=pd.MultiIndex.from_tuples(columns) if multi else columns)
    return df.to_html(escape=False, classes="figs-table", border=0)


def errors_text(errors) -> str:
    if not errors:
        return "none"
    return ", ".join(f"{escape(str(k))}: {v}" for k, v in sorted(errors.items()))


def summary_table(runs: list[Run], task: str, set_: str, levels: list[str]) -> str:
    rows = [[r for r in run.rows if r["task"] == task and r["set"] == set_] for run in runs]
    figures = SUMMARY_FIGURES + extra_figures([r for rs in rows for r in rs], SUMMARY_FIGURES, ROW_KEYS)
    groups = [(lvl, [next((r for r in rs if r["level"] == lvl), None) for rs in rows]) for lvl in levels]
    return figure_table(figures, groups, [run.label for run in runs], errors_row=True)


def quality_table(runs: list[Run]) -> str | None:
    keys = sorted({(q["task"], q["set"]) for run in runs for q in run.quality})
    if not keys:
        return None
    figures = QUALITY_FIGURES + extra_figures([q for run in runs for q in run.quality],
                                              QUALITY_FIGURES, QUALITY_KEYS)
    groups = [(f"{t} / {s}", [next((q for q in run.quality if (q["task"], q["set"]) == (t, s)), None)
                              for run in runs]) for t, s in keys]
    return figure_table(figures, groups, [run.label for run in runs])


def flagged_table(runs: list[Run], limit: int = 25) -> str | None:
    """Clips the quality step flagged (runaway length, silence, clipping, high WER, ...)."""
    records = []
    for run in runs:
        flagged = [q for q in run.quality_clips if q.get("flags")]
        for q in flagged[:limit]:
            records.append({
                "run": escape(run.label), "clip": escape(str(q.get("id"))),
                "flags": escape(", ".join(map(str, q["flags"]))),
                "WER": fmt_value(q.get("wer"), "pct"), "SIM": fmt_value(q.get("sim"), "f3"),
                "duration s": fmt_value(q.get("duration_s"), "f2"),
                "expected s": fmt_value(q.get("expected_s"), "f2"),
                "ASR text": escape(_clip(q.get("asr_text") or "", 120)),
            })
        if len(flagged) > limit:
            records.append({"run": escape(run.label), "clip": f"… {len(flagged) - limit} more"})
    if not records:
        return None
    df = pd.DataFrame(records).fillna("")
    if len(runs) == 1:
        df = df.drop(columns="run")
    return df.to_html(escape=False, index=False, classes="list-table", border=0)


def errors_tables(runs: list[Run], examples: int = 3) -> tuple[str | None, str | None]:
    """Counts of failed requests by kind per (task, set, level), and a few messages of each kind."""
    counts = []
    for run in runs:
        for row in run.rows:
            for kind, n in sorted((row.get("errors") or {}).items()):
                counts.append({"run": run.label, "task": row["task"], "set": row["set"],
                               "level": row["level"], "kind": kind, "n": n})
    if not counts:
        return None, None
    df = pd.DataFrame(counts)
    index = ["run", "task", "set", "level"] if len(runs) > 1 else ["task", "set", "level"]
    pivot = df.pivot_table(index=index, columns="kind", values="n", aggfunc="sum", fill_value=0)
    pivot.columns.name = None
    counts_html = pivot.reset_index().to_html(index=False, classes="list-table", border=0)
    details = []
    for run in runs:
        by_kind: dict[str, dict[str, int]] = {}
        for rec in run.measured():
            if rec.get("ok") or not rec.get("error"):
                continue
            msgs = by_kind.setdefault(rec["error"], {})
            msg = _clip(str(rec.get("error_detail") or ""), 200)
            msgs[msg] = msgs.get(msg, 0) + 1
        for kind, msgs in sorted(by_kind.items()):
            for msg, n in sorted(msgs.items(), key=lambda kv: -kv[1])[:examples]:
                details.append({"run": run.label, "kind": kind, "requests": n, "message": msg or "(none)"})
    details_html = (pd.DataFrame(details).to_html(index=False, classes="list-table", border=0)
                    if details else None)
    return counts_html, details_html


def overview_table(runs: list[Run]) -> str | None:
    """One line per run and task/set: the headline figures, so the first screen answers "how fast"."""
    records = []
    for run in runs:
        quality = {(q["task"], q["set"]): q for q in run.quality}
        for (task, set_), rows in _by_task_set(run.rows).items():
            rows = sorted(rows, key=lambda r: level_key(r["level"]))
            low, high = rows[0], rows[-1]
            rec = {"task / set": escape(f"{task} / {set_}"), "run": run.label,
                   "levels": escape(", ".join(r["level"] for r in rows)),
                   "ok / failed": f"{sum(r.get('completed') or 0 for r in rows):,} / "
                                         f"{sum(r.get('failed') or 0 for r in rows):,}",
                   "TTFAB p50 at lowest load": _at(low, "ttfab_ms_median", "ms"),
                   "TTFAB p95 at highest load": _at(high, "ttfab_ms_p95", "ms"),
                   "E2E p95 at highest load": _at(high, "e2e_ms_p95", "ms"),
                   "peak audio throughput": _peak(rows, "audio_throughput", max, "f2"),
                   "peak requests / s": _peak(rows, "request_throughput", max, "f2"),
                   "worst underrun p95 s": _peak(rows, "underrun_s_p95", max, "f3")}
            if quality:
                q = quality.get((task, set_), {})
                rec["WER mean"] = fmt_value(q.get("wer_mean"), "pct")
                rec["SIM mean"] = fmt_value(q.get("sim_mean"), "f3")
            records.append(rec)
    if not records:
        return None
    order = {run.label: i for i, run in enumerate(runs)}
    records.sort(key=lambda r: (r["task / set"], order[r["run"]]))   # runs of a task/set together
    df = pd.DataFrame(records).fillna("–")
    if len(runs) == 1:
        df = df.drop(columns="run")
    else:
        df["run"] = df["run"].map(escape)
    return df.to_html(escape=False, index=False, classes="list-table overview", border=0)


def _by_task_set(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    out: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        out.setdefault((r["task"], r["set"]), []).append(r)
    return out


def _at(row: dict, key: str, fmt: str) -> str:
    return f"{fmt_value(row.get(key), fmt)} <span class=\"chg\">@{escape(row['level'])}</span>"


def _peak(rows: list[dict], key: str, pick, fmt: str) -> str:
    valued = [r for r in rows if isinstance(r.get(key), (int, float))]
    return _at(pick(valued, key=lambda r: r[key]), key, fmt) if valued else "–"


def run_tables(runs: list[Run]) -> tuple[str, str | None, str | None]:
    """(server and command, every option of the run and its host, package versions), runs side by side."""
    main, options, packages = [], [], []
    for run in runs:
        m = run.meta
        command = m.get("command")
        main.append({
            "directory": str(run.path),
            "started / finished": f"{m.get('started_at') or '?'} / {m.get('finished_at') or 'not finished'}",
            "command": shlex.join(map(str, command)) if isinstance(command, list) else str(command or ""),
            "ttsbench": str(m.get("ttsbench_version", "")),
            "url": str(m.get("url") or ""),
            "embedded server": _compact(m.get("embedded_server")) or "no",
            "server": _compact(m.get("server")) or "not recorded",
            "SLO": _compact(run.summary.get("slo")),
        })
        sessions = m.get("sessions") or []
        if len(sessions) > 1:   # resumed: each invocation's span, so gaps between them are visible
            main[-1]["sessions"] = "; ".join(f"{x.get('started_at') or '?'} – {x.get('finished_at') or 'interrupted'}"
                                             for x in sessions if isinstance(x, dict))
        opts = {f"config: {k}": _compact(v) for k, v in (m.get("config") or {}).items()}
        opts.update({f"host: {k}": _compact(v) for k, v in (m.get("host") or {}).items()})
        options.append(opts)
        packages.append({str(k): str(v) for k, v in (m.get("packages") or {}).items()})
    return (_side_by_side(runs, main, fixed=("directory", "started / finished")),
            _side_by_side(runs, options), _side_by_side(runs, packages, sort=True))


def _side_by_side(runs: list[Run], entries: list[dict[str, str]], fixed=(), sort=False) -> str | None:
    """Keys down the side, one column per run; with several runs, keys whose values differ are marked."""
    keys = list(dict.fromkeys(k for e in entries for k in e))
    if not keys:
        return None
    if sort:
        keys.sort(key=str.lower)
    data = {escape(run.label): [escape(e.get(k, "–")) for k in keys] for run, e in zip(runs, entries)}
    index = [f'<span class="differs" title="differs between runs">{escape(k)}</span>'
             if len(runs) > 1 and k not in fixed and len({e.get(k, "–") for e in entries}) > 1 else escape(k)
             for k in keys]
    return pd.DataFrame(data, index=index).to_html(escape=False, classes="config-table", border=0)


def _compact(value) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return _clip(json.dumps(value, separators=(", ", ": "), default=str), 400)


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"
