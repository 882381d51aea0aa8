"""Per-request figures from raw timestamps, and their aggregation per (task, set, level).

Aggregates are computed only from stored request records, so `ttsbench summarize` reproduces
what `ttsbench run` wrote.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import pandas as pd

from ttsbench.client import RawResponse
from ttsbench.decode import Decoded

FRAMES_PER_AUDIO_S = 12.5  # Qwen3-TTS codec frame rate
STAT_METRICS = ("ttfab_ms", "e2e_ms", "rtf", "underrun_s", "max_gap_ms")
STATS = (("mean", "mean"), ("median", "median"), ("p90", 0.90), ("p95", 0.95), ("p99", 0.99), ("max", "max"))


@dataclass(frozen=True)
class SLO:
    """A request is good when it completed, its first audio came before ttfab_ms, and playback
    starved for at most underrun_s."""
    ttfab_ms: float = 200.0
    underrun_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def stalls(chunks: list[tuple[float, float]], buffer_s: float = 0.0) -> list[tuple[float, float]]:
    """(start, end) of each starvation of a player that starts `buffer_s` after the first audio
    arrives (or at the last arrival, if the stream ends sooner) and then plays in real time,
    pausing whenever it has played everything received. `chunks`: (arrival s, audio s), in order."""
    if not chunks:
        return []
    runs_dry_at = min(chunks[0][0] + buffer_s, chunks[-1][0])
    out = []
    for t, seconds in chunks:
        if t > runs_dry_at:
            out.append((runs_dry_at, t))
            runs_dry_at = t
        runs_dry_at += seconds
    return out


def underrun(chunks: list[tuple[float, float]], buffer_s: float = 0.0) -> tuple[float, float]:
    """Total and worst starvation (seconds) of the player of `stalls`."""
    gaps = [b - a for a, b in stalls(chunks, buffer_s)]
    return sum(gaps), max(gaps, default=0.0)


def first_starved_chunk(chunks: list[tuple[float, float]]) -> int | None:
    """Index of the first chunk that came after the player of `stalls` (no start-up buffer) had run dry: which
    step of a server's chunk schedule was late (a second chunk: the first chunk's audio too short for the next to
    be ready). None when playback never starved."""
    starved = stalls(chunks)
    if not starved:
        return None
    return next(i for i, (t, _) in enumerate(chunks) if t == starved[0][1])


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def request_figures(raw: RawResponse, dec: Decoded, playback_buffer_s: float = 0.0) -> dict:
    """The timing fields of a request record (see docs/run-format.md)."""
    t0 = raw.t_start
    chunks = dec.chunks
    first = chunks[0][0] if chunks else None
    gaps = [b[0] - a[0] for a, b in zip(chunks, chunks[1:])]
    arrivals = [(t, s) for t, _, s in chunks]
    total, worst = underrun(arrivals)
    buffered, _ = underrun(arrivals, playback_buffer_s)
    ok = dec.error is None
    e2e = None if raw.t_end is None else raw.t_end - t0
    return {
        "ok": ok,
        "error": dec.error,
        "error_detail": dec.error_detail,
        "http_status": raw.status,
        "t_start": t0,
        "t_headers_ms": None if raw.t_headers is None else _ms(raw.t_headers - t0),
        "ttfab_ms": None if first is None else _ms(first - t0),
        "e2e_ms": _ms(e2e),
        "chunks": [[_ms(t - t0), n] for t, n, _ in chunks],
        "bytes": dec.n_bytes,
        "sample_rate": dec.sample_rate,
        "audio_s": dec.audio_s,  # exact: samples / rate
        "rtf": round(e2e / dec.audio_s, 6) if ok and e2e is not None and dec.audio_s else None,
        "n_chunks": len(chunks),
        "max_gap_ms": _ms(max(gaps)) if gaps else None,
        "underrun_s": round(total, 6) if chunks else None,
        "underrun_max_s": round(worst, 6) if chunks else None,
        "underrun_buffered_s": round(buffered, 6) if chunks else None,
        "underrun_chunk": first_starved_chunk(arrivals),
    }


def _meets(row: pd.Series, slo: SLO) -> bool:
    return bool(row["ok"] and row["ttfab_ms"] is not None and row["ttfab_ms"] < slo.ttfab_ms
                and row["underrun_s"] is not None and row["underrun_s"] <= slo.underrun_s)


def _duration(group: pd.DataFrame) -> float:
    """First send to last end, summed over resume sessions so the pause between them is not counted."""
    ends = group["t_start"] + group["e2e_ms"].fillna(0.0) / 1000.0
    spans = pd.DataFrame({"session": group["session"], "start": group["t_start"], "end": ends})
    per = spans.groupby("session").agg(start=("start", "min"), end=("end", "max"))
    return float((per["end"] - per["start"]).sum())


def _full_load(group: pd.DataFrame) -> dict:
    """The full-load figures of a closed-loop level: its span from the start of its c-th request to the start of
    its last one (per resume session, summed), throughout which c requests are in flight, each finished one
    replaced at once; the audio received in it per second (by chunk arrival); and the TTFAB of the requests that
    started after the first c, each arriving at a server busy with c - 1 others. That is the server's steady
    state: neither the ramp-up, where the first c arrive at once, nor the drain at the end, where fewer and fewer
    requests (the longest) are left. Null where there is no such span (an open-loop level, no more requests than
    the concurrency, or chunk times not recorded)."""
    fields = dict.fromkeys(("full_load_s", "full_load_audio_throughput", "full_load_ttfab_ms_median",
                            "full_load_ttfab_ms_p95"))
    c = group["concurrency"].iloc[0]
    if "chunks" not in group or pd.isna(c):
        return fields
    c = int(c)
    span_s = audio_s = 0.0
    ttfabs = []  # per session; not empty once there is a span
    for _, session in group.groupby("session"):
        if len(session) <= c:
            continue
        session = session.sort_values("t_start", kind="stable")
        ok = session[session["ok"].astype(bool)]
        begin, end = float(session["t_start"].iloc[c - 1]), float(session["t_start"].iloc[-1])
        span_s += end - begin
        ttfabs.append(pd.to_numeric(ok.loc[ok.index.isin(session.index[c:]), "ttfab_ms"], errors="coerce"))
        for r in ok.itertuples():
            total = sum(n for _, n in r.chunks)
            if total and r.audio_s:
                audio_s += r.audio_s * sum(n for ms, n in r.chunks if begin <= r.t_start + ms / 1000.0 <= end) / total
    if span_s <= 0:
        return fields
    fields.update(full_load_s=round(span_s, 6), full_load_audio_throughput=round(audio_s / span_s, 6))
    values = pd.concat(ttfabs).dropna()
    if not values.empty:
        fields.update(full_load_ttfab_ms_median=round(float(values.median()), 6),
                      full_load_ttfab_ms_p95=round(float(values.quantile(0.95)), 6))
    return fields


def _starved(ok: pd.DataFrame) -> dict:
    """How many completed requests' playback starved, and at which chunk each first did (index -> requests;
    records from before `underrun_chunk` give their count alone)."""
    if ok.empty or "underrun_s" not in ok:
        return {"starved": 0, "starved_at_chunk": {}}
    starved = ok[pd.to_numeric(ok["underrun_s"], errors="coerce").fillna(0.0) > 0]
    at = starved["underrun_chunk"].dropna().astype(int) if "underrun_chunk" in starved else pd.Series(dtype=int)
    return {"starved": int(len(starved)),
            "starved_at_chunk": {str(k): int(v) for k, v in sorted(at.value_counts().items())}}


def _none(value):
    return None if value is None or pd.isna(value) else float(value)


def summarize(records: list[dict], slo: SLO) -> list[dict]:
    """One row per (task, set, level) in order of first appearance; warmup requests excluded."""
    measured = [r for r in records if not r.get("warmup")]
    if not measured:
        return []
    df = pd.DataFrame(measured)
    df["session"] = df["session"].fillna(0) if "session" in df else 0
    rows = []
    for (task, set_name, level), group in df.groupby(["task", "set", "level"], sort=False):
        ok = group[group["ok"].astype(bool)]
        duration = _duration(group)
        total_audio = float(ok["audio_s"].sum()) if len(ok) else 0.0
        first = group.iloc[0]
        row = {
            "task": task, "set": set_name, "level": level, "mode": first["mode"],
            "concurrency": None if pd.isna(first["concurrency"]) else int(first["concurrency"]),
            "rate": _none(first["rate"]),
            "completed": int(len(ok)), "failed": int(len(group) - len(ok)),
            "errors": {str(k): int(v) for k, v in group["error"].dropna().value_counts().items()},
            "duration_s": round(duration, 6),
            "request_throughput": round(len(ok) / duration, 6) if duration > 0 else None,
            "audio_throughput": round(total_audio / duration, 6) if duration > 0 else None,
            "frames_per_s": round(total_audio / duration * FRAMES_PER_AUDIO_S, 6) if duration > 0 else None,
            "total_audio_s": round(total_audio, 6),
            **_full_load(group),
            "goodput": round(float(group.apply(_meets, axis=1, slo=slo).mean()), 6),
            **_starved(ok),
        }
        for metric in STAT_METRICS:
            values = pd.to_numeric(ok[metric], errors="coerce").dropna() if len(ok) else pd.Series(dtype=float)
            for name, how in STATS:
                if values.empty:
                    row[f"{metric}_{name}"] = None
                elif isinstance(how, float):
                    row[f"{metric}_{name}"] = round(float(values.quantile(how)), 6)
                else:
                    row[f"{metric}_{name}"] = round(float(getattr(values, how)()), 6)
        rows.append(row)
    return rows


def rows_frame(rows: list[dict]) -> pd.DataFrame:
    """summary.csv's table: the rows, with `errors` and `starved_at_chunk` as JSON cells."""
    df = pd.DataFrame(rows)
    for column in ("errors", "starved_at_chunk"):
        if column in df:
            df[column] = df[column].map(lambda e: json.dumps(e, sort_keys=True))
    return df
