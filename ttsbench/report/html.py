"""Assembling the report: one self-contained HTML file (inline CSS, PNG figures as data: URIs).

No script, no font or stylesheet from the network: the file opens the same on an offline laptop,
attached to a CI job, or mailed around.
"""

from __future__ import annotations

import base64
import datetime as dt
from html import escape
from pathlib import Path

from ttsbench import __version__
from ttsbench.report import plots, tables
from ttsbench.report.playback import playback
from ttsbench.report.rundir import Run, level_key, level_mode, load_run, unique_labels

_CSS = """
:root { --fg:#1d2330; --muted:#5b6475; --line:#d9dee7; --bg2:#f4f6fa; --bad:#b3261e; --good:#1e7b34; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--fg);
       margin: 0 auto; padding: 0 24px 48px; max-width: 1400px; }
header { border-bottom: 2px solid var(--line); padding: 16px 0 8px; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 19px; margin: 32px 0 8px;
  border-bottom: 1px solid var(--line); padding-bottom: 4px; } h3 { font-size: 15px; margin: 20px 0 6px; }
.meta, .note, figcaption { color: var(--muted); font-size: 12.5px; }
nav { font-size: 13px; margin-top: 6px; } nav a { margin-right: 12px; white-space: nowrap; }
.scroll { overflow-x: auto; max-width: 100%; }
table { border-collapse: collapse; font-size: 12.5px; font-variant-numeric: tabular-nums; margin: 4px 0 8px; }
th, td { border-bottom: 1px solid var(--line); padding: 3px 9px; text-align: right; white-space: nowrap; }
thead th { background: var(--bg2); text-align: center; position: sticky; top: 0; }
tbody th { text-align: left; font-weight: 500; background: #fafbfd; }
table.config-table td, table.list-table td { text-align: left; white-space: normal; max-width: 560px;
  overflow-wrap: anywhere; }
.chg { color: var(--muted); font-size: 11.5px; } .chg.worse { color: var(--bad); } .chg.better { color: var(--good); }
table.overview td { white-space: nowrap; } table.overview th { white-space: normal; min-width: 70px; }
.missing { color: var(--bad); font-style: italic; }
.differs { background: #fff3c4; padding: 0 3px; }
.figs { display: grid; grid-template-columns: 1fr; gap: 14px; }
figure { margin: 0; } figure img { width: 100%; max-width: 1100px; height: auto; display: block;
  border: 1px solid var(--line); }
details summary { cursor: pointer; color: var(--muted); }
.warn { background: #fdecea; border-left: 4px solid var(--bad); padding: 6px 10px; }
"""


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'


def _figure(kind: str, png: bytes, caption: str) -> str:
    return (f'<figure data-figure="{kind}">{_img(png, caption)}'
            f"<figcaption>{escape(caption)}</figcaption></figure>")


def _slug(*parts: str) -> str:
    return "-".join("".join(c if c.isalnum() else "_" for c in p) for p in parts)


def groups_of(runs: list[Run]) -> list[tuple[str, str, str, list[str]]]:
    """(task, set, mode, levels) for every task/set measured in any run, levels in load order."""
    found: dict[tuple[str, str, str], set[str]] = {}
    for run in runs:
        for row in run.rows:
            found.setdefault((row["task"], row["set"], level_mode(row["level"])), set()).add(row["level"])
    return [(t, s, m, sorted(lv, key=level_key)) for (t, s, m), lv in sorted(found.items())]


def _group_section(runs: list[Run], task: str, set_: str, mode: str, levels: list[str]) -> str:
    sid = _slug("results", task, set_, mode)
    by = plots.axis_label(mode)
    parts = [f'<section id="{sid}" class="group" data-task="{escape(task)}" data-set="{escape(set_)}" '
             f'data-mode="{mode}">',
             f"<h2>{escape(task)} / {escape(set_)} by {by}</h2>",
             "<h3>Summary figures by level</h3>",
             f'<div class="scroll">{tables.summary_table(runs, task, set_, levels)}</div>']
    if len(runs) > 1:
        parts.append(f'<p class="note">Each run beside the first ({escape(runs[0].label)}), with the '
                     "relative change; red is worse, green better.</p>")
    figs = [
        _figure("latency", plots.percentiles_vs_load(
            runs, task, set_, levels, mode, [("ttfab_ms", "time to first audio byte"), ("e2e_ms", "end to end")]),
            f"TTFAB and E2E p50 / p95 / p99 against {by}."),
        _figure("throughput", plots.throughput_vs_load(runs, task, set_, levels, mode),
                f"Audio throughput (dotted: real time; dashed: at full load, where a level has such a span) and request throughput against {by}."),
    ]
    # Distributions need per-request records, which a baseline file does not keep.
    with_records = [run for run in runs if any(r.get("task") == task and r.get("set") == set_ for r in run.measured())]
    if with_records:
        names = "" if len(with_records) == len(runs) else f" ({', '.join(r.label for r in with_records)})"
        figs += [
            _figure("rtf", plots.rtf_distribution(runs, task, set_, levels, mode),
                    f"Distribution of per-request RTF at each {by} level{names}."),
            _figure("ttfab-cdf", plots.ttfab_cdf(runs, task, set_, levels, mode),
                    f"Cumulative distribution of TTFAB per level{names}."),
        ]
    for run in runs:
        over_time = plots.audio_over_time(run, task, set_, levels)
        if over_time is not None:
            figs.append(_figure("delivery", over_time,
                                f"{run.label}: audio received per second over each level's wall time, and "
                                "requests in flight: the ramp, the span at full load and the drain that the "
                                "level's throughput averages."))
        picked = [r for r in plots.pick_timeline_requests(run, task, set_, levels) if playback(r)]
        if picked:
            title = f"{run.label}: chunk arrivals" if len(runs) > 1 else "chunk arrivals"
            figs.append(_figure("timeline", plots.chunk_timelines(picked, title),
                                f"{run.label}: audio received and played for {len(picked)} requests "
                                "(the worst underrun at the highest level and typical ones); red bands are "
                                "stalls of a player starting at the first audio byte."))
    parts.append('<h3>Figures</h3><div class="figs">' + "".join(figs) + "</div></section>")
    return "\n".join(parts)


def _notes(runs: list[Run]) -> list[str]:
    """Data problems a reader should know about before trusting the figures."""
    notes = []
    for run in runs:
        if run.bad_lines:
            notes.append(f"{run.label}: {run.bad_lines} unreadable line(s) in requests.jsonl/quality.jsonl were skipped.")
        if not run.meta.get("finished_at"):
            notes.append(f"{run.label}: the run has no finished_at; it was interrupted or is still running.")
        if not run.rows:
            notes.append(f"{run.label}: summary.json has no rows (no measured requests).")
        off = 0
        for rec in run.measured():
            pb, stored = playback(rec), rec.get("underrun_s")
            if pb and isinstance(stored, (int, float)) and abs(pb.underrun_s - stored) > 0.01 + 0.01 * stored:
                off += 1
        if off:
            notes.append(f"{run.label}: for {off} request(s) the underrun recomputed from the chunk timings "
                         "differs from the stored underrun_s by more than 10 ms (written by another harness version?).")
    return notes


def render(runs: list[Run]) -> str:
    unique_labels(runs)
    groups = groups_of(runs)
    labels = ", ".join(run.label for run in runs)
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    nav = ['<a href="#overview">overview</a>', '<a href="#configuration">configuration</a>']
    nav += [f'<a href="#{_slug("results", t, s, m)}">{escape(t)} / {escape(s)}'
            f'{" (rate)" if m == "rate" else ""}</a>' for t, s, m, _ in groups]
    nav += ['<a href="#quality">quality</a>', '<a href="#errors">errors</a>']
    body = [f"<header><h1>ttsbench report: {escape(labels)}</h1>",
            f'<div class="meta">{len(runs)} run(s); generated {now} by ttsbench {__version__}</div>',
            f"<nav>{''.join(nav)}</nav></header>"]
    notes = _notes(runs)
    if notes:
        body.append('<div class="warn" id="notes">' + "<br>".join(escape(n) for n in notes) + "</div>")

    overview = tables.overview_table(runs)
    if overview:
        body.append('<section id="overview"><h2>Overview</h2>'
                    f'<div class="scroll">{overview}</div></section>')

    main, options, packages = tables.run_tables(runs)
    body.append('<section id="configuration"><h2>Run configuration and server</h2>')
    body.append(f'<div class="scroll">{main}</div>')
    for title, table in (("every run option and the host", options), ("package versions", packages)):
        if table:
            body.append(f'<details{" open" if len(runs) > 1 and "differs" in table else ""}>'
                        f'<summary>{title}</summary><div class="scroll">{table}</div></details>')
    body.append("</section>")

    if not groups:
        body.append('<p class="missing">No summary rows in any run: nothing was measured.</p>')
    body += [_group_section(runs, t, s, m, lv) for t, s, m, lv in groups]

    body.append('<section id="quality"><h2>Quality</h2>')
    qt = tables.quality_table(runs)
    if qt:
        body.append('<h3>WER / CER, SIM and sanity flags per task and set</h3>'
                    f'<div class="scroll">{qt}</div>')
        ft = tables.flagged_table(runs)
        body.append("<h3>Flagged clips</h3>" + (f'<div class="scroll">{ft}</div>' if ft
                                              else '<p class="note">No clip was flagged.</p>'))
    else:
        body.append('<p class="note">Not scored: run <code>ttsbench quality RUN_DIR</code> to add WER, '
                    "SIM and sanity checks.</p>")
    body.append("</section>")

    body.append('<section id="errors"><h2>Errors by kind</h2>')
    counts, details = tables.errors_tables(runs)
    if counts:
        body.append(f'<div class="scroll">{counts}</div>')
        if details:
            body.append(f'<h3>Messages</h3><div class="scroll">{details}</div>')
    else:
        body.append('<p class="note">No request failed.</p>')
    body.append("</section>")

    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>ttsbench report: {escape(labels)}</title><style>{_CSS}</style></head>\n<body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def build_report(run_dirs: list[str | Path], out: str | Path) -> Path:
    """Read the run directories and write the report to `out` (RunDirError on unusable input)."""
    runs = [load_run(p) for p in run_dirs]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(runs), encoding="utf-8")
    return out
