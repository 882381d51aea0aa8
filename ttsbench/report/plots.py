"""The report's figures, drawn with matplotlib and returned as PNG bytes for embedding.

Load levels go on a categorical x axis in numeric order (c1, c2, c8 ... or r0.5, r2, rinf), so an
open-loop `rinf` level has a place and doubling concurrencies are evenly spaced. Runs are told
apart by colour everywhere; percentiles by line style. Figures are built on matplotlib.figure.Figure
(no pyplot), so no GUI backend or global state is involved.
"""

from __future__ import annotations

import io

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from PIL import Image

from ttsbench.report.playback import playback, timed_audio
from ttsbench.report.rundir import Run, level_key

RUN_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
_PCT_STYLES = (("median", "p50", "-"), ("p95", "p95", "--"), ("p99", "p99", ":"))
_RUN_STYLES = ("-", "--", ":", "-.")
DPI = 100


def to_png(fig: Figure) -> bytes:
    """PNG bytes, reduced to a 256-colour palette: plots are flat colours, and the report stays about
    three times smaller (it is mailed around and kept as a CI artifact)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight", facecolor="white")
    buf.seek(0)
    image = Image.open(buf).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=True)
    return out.getvalue()


def level_tick(level: str) -> str:
    """'c8' -> '8', 'r2.5' -> '2.5', 'rinf' -> 'inf' (the axis label says which)."""
    return level[1:] if level_key(level)[0] in ("c", "r") else level


def axis_label(mode: str) -> str:
    return "request rate (req/s)" if mode == "rate" else "concurrency"


def _rows_by_level(run: Run, task: str, set_: str) -> dict[str, dict]:
    return {r["level"]: r for r in run.rows if r["task"] == task and r["set"] == set_}


def _series(rows: dict[str, dict], levels: list[str], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for i, lvl in enumerate(levels):
        v = rows.get(lvl, {}).get(key)
        if isinstance(v, (int, float)):
            xs.append(i)
            ys.append(v)
    return xs, ys


def _level_axis(ax, levels: list[str], mode: str) -> None:
    ax.set_xticks(range(len(levels)), [level_tick(lvl) for lvl in levels])
    ax.set_xlim(-0.5, len(levels) - 0.5)
    ax.set_xlabel(axis_label(mode))
    ax.grid(True, alpha=0.3)


def _run_legend(ax, runs: list[Run]) -> None:
    if len(runs) > 1:
        for i, run in enumerate(runs):
            ax.plot([], [], color=RUN_COLORS[i % len(RUN_COLORS)], label=run.label)


def percentiles_vs_load(runs, task, set_, levels, mode, metrics: list[tuple[str, str]]) -> bytes:
    """One panel per metric (e.g. TTFAB, E2E): p50/p95/p99 against load, one colour per run."""
    fig = Figure(figsize=(11, 3.8))
    axes = fig.subplots(1, len(metrics), squeeze=False)[0]
    for ax, (metric, title) in zip(axes, metrics):
        for i, run in enumerate(runs):
            rows = _rows_by_level(run, task, set_)
            color = RUN_COLORS[i % len(RUN_COLORS)]
            for suffix, name, style in _PCT_STYLES:
                xs, ys = _series(rows, levels, f"{metric}_{suffix}")
                ax.plot(xs, ys, style, marker="o", ms=4, color=color, label=name if len(runs) == 1 else None)
        _level_axis(ax, levels, mode)
        ax.set_title(title)
        ax.set_ylabel("ms")
        ax.set_ylim(bottom=0)
        if len(runs) > 1:
            for suffix, name, style in _PCT_STYLES:
                ax.plot([], [], style, color="gray", label=name)
            _run_legend(ax, runs)
        ax.legend(fontsize=8, ncol=2 if len(runs) > 1 else 1)
    fig.tight_layout()
    return to_png(fig)


def throughput_vs_load(runs, task, set_, levels, mode) -> bytes:
    """Audio throughput (audio seconds per second; dashed: at full load, where the level has such a span) and
    request throughput against load."""
    fig = Figure(figsize=(11, 3.8))
    ax_audio, ax_req = fig.subplots(1, 2)
    for ax, key, title, unit in ((ax_audio, "audio_throughput", "audio throughput", "audio s / s"),
                                 (ax_req, "request_throughput", "request throughput", "requests / s")):
        full_load = False
        for i, run in enumerate(runs):
            color, rows = RUN_COLORS[i % len(RUN_COLORS)], _rows_by_level(run, task, set_)
            xs, ys = _series(rows, levels, key)
            ax.plot(xs, ys, "-", marker="o", ms=4, color=color, label=run.label)
            if key == "audio_throughput":
                xs, ys = _series(rows, levels, "full_load_audio_throughput")
                ax.plot(xs, ys, "--", marker="s", ms=3, color=color)
                full_load = full_load or bool(xs)
        _level_axis(ax, levels, mode)
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
        if key == "audio_throughput":
            ax.axhline(1.0, color="gray", lw=0.8, ls=":")
            if full_load:
                ax.plot([], [], "--", marker="s", ms=3, color="gray", label="at full load")
        if len(runs) > 1 or full_load:
            ax.legend(fontsize=8)
    fig.tight_layout()
    return to_png(fig)


def _values(run: Run, task, set_, level, key) -> list[float]:
    return [r[key] for r in run.measured()
            if r.get("task") == task and r.get("set") == set_ and r.get("level") == level
            and r.get("ok") and isinstance(r.get(key), (int, float))]


def rtf_distribution(runs, task, set_, levels, mode) -> bytes:
    """Box plot of per-request RTF at each level; the dotted line is real time (RTF 1)."""
    fig = Figure(figsize=(11, 3.8))
    ax = fig.subplots()
    n = len(runs)
    width = 0.7 / n
    for i, run in enumerate(runs):
        data, pos = [], []
        for j, lvl in enumerate(levels):
            vals = _values(run, task, set_, lvl, "rtf")
            if vals:
                data.append(vals)
                pos.append(j - 0.35 + width * (i + 0.5))
        if not data:
            continue
        color = RUN_COLORS[i % len(RUN_COLORS)]
        ax.boxplot(data, positions=pos, widths=width * 0.85, patch_artist=True, manage_ticks=False,
                   boxprops={"facecolor": color, "alpha": 0.35, "edgecolor": color},
                   medianprops={"color": color}, whiskerprops={"color": color}, capprops={"color": color},
                   flierprops={"markeredgecolor": color, "markersize": 3})
    ax.axhline(1.0, color="gray", lw=0.8, ls=":", label="real time (RTF 1)")
    _level_axis(ax, levels, mode)
    ax.set_title("RTF per request (lower is faster)")
    ax.set_ylabel("RTF")
    ax.set_ylim(bottom=0)
    _run_legend(ax, runs)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return to_png(fig)


def ttfab_cdf(runs, task, set_, levels, mode) -> bytes:
    """Empirical CDF of time to first audio byte, one curve per level (and line style per run)."""
    fig = Figure(figsize=(11, 3.8))
    ax = fig.subplots()
    cmap = matplotlib.colormaps["viridis"]
    all_vals = []
    for i, run in enumerate(runs):
        for j, lvl in enumerate(levels):
            vals = np.sort(_values(run, task, set_, lvl, "ttfab_ms"))
            if not len(vals):
                continue
            all_vals.extend(vals)
            y = np.arange(1, len(vals) + 1) / len(vals)
            label = level_tick(lvl) if len(runs) == 1 else f"{level_tick(lvl)} · {run.label}"
            ax.step(vals, y, where="post", color=cmap(j / max(1, len(levels) - 1) * 0.8),
                    ls=_RUN_STYLES[i % len(_RUN_STYLES)], label=label)
    if all_vals and min(all_vals) > 0 and max(all_vals) / min(all_vals) > 30:
        ax.set_xscale("log")
    ax.set_title(f"TTFAB CDF by {axis_label(mode)}")
    ax.set_xlabel("time to first audio byte (ms)")
    ax.set_ylabel("share of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    if all_vals:
        ax.legend(fontsize=8, ncol=max(1, (len(levels) * len(runs)) // 8), title=axis_label(mode),
                  title_fontsize=8)
    fig.tight_layout()
    return to_png(fig)


def delivery_series(records: list[dict], bins: int = 40) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Over a level's wall time, from its first request sent to its last byte in `bins` equal slices: (slice
    starts in s, audio seconds received per second in each, mean requests in flight in each), from each
    record's send time and timed chunks. None when no record has timed audio."""
    sends = [(r["t_start"], r) for r in records if isinstance(r.get("t_start"), (int, float))]
    events = [(t + arrival, seconds) for t, r in sends for arrival, seconds in (timed_audio(r) or [])]
    if not events:
        return None
    t0 = min(t for t, _ in sends)
    spans = [(t - t0, t - t0 + r["e2e_ms"] / 1000.0) for t, r in sends if isinstance(r.get("e2e_ms"), (int, float))]
    end = max(max(t for t, _ in events) - t0, max((b for _, b in spans), default=0.0))
    edges = np.linspace(0.0, end, bins + 1)
    width = edges[1] - edges[0]
    audio, _ = np.histogram([t - t0 for t, _ in events], bins=edges, weights=[s for _, s in events])
    flight = np.array([sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in spans)
                       for lo, hi in zip(edges[:-1], edges[1:])]) / width
    return edges[:-1], audio / width, flight


def audio_over_time(run: Run, task, set_, levels) -> bytes | None:
    """Audio received per second over each level's wall time, and requests in flight: where a level ramps up,
    holds and drains (its throughput is the mean over all three; "at full load" is the middle one)."""
    series = [(level, delivery_series([r for r in run.measured() if r.get("task") == task
                                       and r.get("set") == set_ and r.get("level") == level])) for level in levels]
    series = [(level, s) for level, s in series if s is not None]
    if not series:
        return None
    fig = Figure(figsize=(11, 3.6))
    ax_audio, ax_flight = fig.subplots(1, 2)
    cmap = matplotlib.colormaps["viridis"]
    for k, (level, (starts, audio, flight)) in enumerate(series):
        color = cmap(k / max(1, len(series) - 1))
        ax_audio.step(starts, audio, where="post", color=color, label=level)
        ax_flight.step(starts, flight, where="post", color=color, label=level)
    for ax, title, unit in ((ax_audio, "audio received over the level", "audio s / s"),
                            (ax_flight, "requests in flight", "requests")):
        ax.set_title(title)
        ax.set_xlabel("time since the level's first request (s)")
        ax.set_ylabel(unit)
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    ax_audio.legend(fontsize=8, ncol=max(1, len(series) // 6))
    fig.suptitle(f"{run.label}: {task} / {set_}", fontsize=10)
    fig.tight_layout()
    return to_png(fig)


def pick_timeline_requests(run: Run, task, set_, levels, n: int = 3) -> list[dict]:
    """A few telling streams: the worst underrun at the highest level, and typical ones.

    Chosen from the highest level (worst underrun, then median E2E) and the lowest (median E2E).
    """
    chosen: list[dict] = []

    def cands(level):
        return [r for r in run.measured() if r.get("task") == task and r.get("set") == set_
                and r.get("level") == level and r.get("ok") and r.get("chunks")]

    def median_e2e(recs):
        recs = sorted((r for r in recs if isinstance(r.get("e2e_ms"), (int, float))), key=lambda r: r["e2e_ms"])
        return recs[len(recs) // 2] if recs else None

    levels_present = [lvl for lvl in levels if cands(lvl)]
    if not levels_present:
        return []
    top, low = cands(levels_present[-1]), cands(levels_present[0])
    worst = max(top, key=lambda r: getattr(playback(r), "underrun_s", 0.0))
    for rec in (worst, median_e2e(top), median_e2e(low)):
        if rec is not None and all(rec["id"] != c["id"] for c in chosen):
            chosen.append(rec)
    return chosen[:n]


def chunk_timelines(records: list[dict], title: str) -> bytes:
    """Audio received vs played over time for each request; red bands are playback stalls."""
    fig = Figure(figsize=(11, 2.9 * len(records)))
    axes = fig.subplots(len(records), 1, squeeze=False)[:, 0]
    for ax, rec in zip(axes, records):
        pb = playback(rec)
        ax.step(pb.arrival_t, pb.received_s, where="post", color="#1f77b4", label="audio received")
        ax.plot(pb.arrival_t, pb.received_s, "|", color="#1f77b4", ms=8)
        played_t, played_s = pb.played_curve()
        ax.plot(played_t, played_s, color="#2ca02c", lw=1.2, label="played (player starts at first audio)")
        for k, (a, b) in enumerate(pb.stalls):
            ax.axvspan(a, b, color="#d62728", alpha=0.25, lw=0, label="underrun" if k == 0 else None)
        ax.axvline(pb.arrival_t[0], color="gray", ls=":", lw=0.8)
        stored = rec.get("underrun_s")
        stored_txt = f", stored {stored:.3f} s" if isinstance(stored, (int, float)) else ""
        ax.set_title(f"{rec['id']}: {len(pb.arrival_t)} chunks, TTFAB {pb.arrival_t[0] * 1000:.0f} ms, "
                     f"underrun {pb.underrun_s:.3f} s in {len(pb.stalls)} stalls{stored_txt}", fontsize=9)
        ax.set_ylabel("audio s")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    axes[-1].set_xlabel("time since request sent (s)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return to_png(fig)
