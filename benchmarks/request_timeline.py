"""Where the first audio of a load level's requests went inside the server: a `ttsbench serve --request-log` file.

    python benchmarks/request_timeline.py SERVER_REQUESTS.jsonl --concurrency C [--warmup W] [--slices N]
                                          [--json OUT.json]

After its W warmup requests, a closed-loop level sends C requests at once (the first wave) and each later
one when a stream's previous request ends; the two groups meet different servers (idle and burst-hit vs
steady), so they are summarised apart: for each step between two milestones of
serving.engine.engine.TIMELINE (the server's arrival first) the p50 / p95 / max in ms, and the batch sizes
the requests met. The steps are those of the first audio, then those of the end (last frame to the last chunk's
codec call, that call, and its way out to the response's end: what a short request's end-to-end time adds
after its frames). gpu_bench.sh writes one file per level and runs this on it.

Then the first wave's admissions, in order: when each began (ms after the wave's first arrival), how many prompts
it prefilled together, how many rows were running, and how long its prefill took as the talker saw it (admitted to
prefilled: a prefill pauses every running stream, and the first wave's own first audio waits on it).

Then the generation's pace over the level, in --slices equal slices of time from the first prefill to the last
frame: rows generating (mean), frames per second and ms per step (rows / frames per second). The log keeps no
per-frame times, so each request counts as generating at its own mean rate from its prefill to its last frame:
a slice's pace is that of the steps its requests met, pauses for other requests' prefills included. It shows
what a level's throughput is made of: the first wave's ramp, the full-load steps (and whether they slow as
contexts grow), and the tail, where the last requests run with few rows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

# (name, from milestone, to milestone): the first audio's path through the server, in order, then the end's: the
# last chunk's wait for the codec after the last frame, its codec call, and its way out to the response's end
STEPS = (
    ("accept", "arrival", "submit"),
    ("queue", "submit", "admitted"),
    ("prefill", "admitted", "prefilled"),
    ("first_frames", "prefilled", "first_due"),
    ("codec_wait", "first_due", "first_codec_start"),
    ("codec_call", "first_codec_start", "first_codec_end"),
    ("deliver", "first_codec_end", "first_taken"),
    ("write", "first_taken", "first_sent"),
    ("first_audio", "arrival", "first_sent"),
    ("last_wait", "last_frame", "last_codec_start"),
    ("last_call", "last_codec_start", "last_codec_end"),
    ("last_out", "last_codec_end", "end"),
)
BATCHES = ("prefill_batch", "running", "first_codec_batch")


def load(path: Path) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(records, key=lambda r: r["arrival"])


def summarise(records: list[dict]) -> dict:
    """{"n", "steps": {step: {"p50", "p95", "max", "n"}}, "batches": {name: {"mean", "max"}}}; ms."""
    steps = {}
    marks = [{"arrival": 0.0, **r["ms"]} for r in records]
    for name, start, end in STEPS:
        values = [ms[end] - ms[start] for ms in marks if start in ms and end in ms]
        if values:
            v = np.asarray(values)
            steps[name] = {"p50": round(float(np.percentile(v, 50)), 2), "p95": round(float(np.percentile(v, 95)), 2),
                           "max": round(float(v.max()), 2), "n": len(values)}
    batches = {}
    for name in BATCHES:
        values = [r[name] for r in records if name in r]
        if values:
            batches[name] = {"mean": round(float(np.mean(values)), 1), "max": int(max(values))}
    return {"n": len(records), "steps": steps, "batches": batches}


def split_waves(records: list[dict], concurrency: int, warmup: int = 0) -> dict[str, list[dict]]:
    """The completed requests of the first wave and of the rest, in order of arrival, warmup left out."""
    measured = [(i, r) for i, r in enumerate(records[warmup:]) if r["outcome"] == "ok"]
    return {"first wave": [r for i, r in measured if i < concurrency],
            "later": [r for i, r in measured if i >= concurrency]}


ADMISSION_GAP_MS = 0.5


def admissions(records: list[dict]) -> list[dict]:
    """[{"at_ms", "prompts", "running", "prefill_ms"}] of the admissions the records met, in order; at_ms counts
    from the first record's arrival. Requests admitted together share their admitted and prefilled instants, to
    within the log's rounding (each record's times are rounded from its own arrival), so instants less than
    ADMISSION_GAP_MS apart are one admission; two admissions are at least a prefill apart."""
    if not records:
        return []
    start = records[0]["arrival"]
    instants = sorted((((r["arrival"] - start) * 1e3 + r["ms"]["admitted"], r) for r in records
                       if "admitted" in r["ms"] and "prefilled" in r["ms"]), key=lambda e: e[0])
    rows, last = [], None
    for at, r in instants:
        if last is None or at - last >= ADMISSION_GAP_MS:
            rows.append({"at_ms": round(at, 1), "prompts": r.get("prefill_batch"), "running": r.get("running"),
                         "prefill_ms": round(r["ms"]["prefilled"] - r["ms"]["admitted"], 1)})
        last = at
    return rows


def render_admissions(rows: list[dict]) -> str:
    lines = ["| at ms | prompts | running | prefill ms |", "|---|---|---|---|"]
    lines += [f"| {r['at_ms']:.1f} | {r['prompts']} | {r['running']} | {r['prefill_ms']:.1f} |" for r in rows]
    return "\n".join(lines)


def pace(records: list[dict], slices: int = 10) -> list[dict]:
    """[{"from_s", "to_s", "rows", "frames_per_s", "ms_per_step"}] over `slices` equal slices of the span from
    the first prefill to the last frame, seconds from its start; each request generating at its mean rate."""
    spans = [(r["arrival"] + r["ms"]["prefilled"] / 1e3, r["arrival"] + r["ms"]["last_frame"] / 1e3, r["frames"])
             for r in records if r.get("frames") and "prefilled" in r["ms"] and "last_frame" in r["ms"]]
    spans = [(a, b, f) for a, b, f in spans if b > a]
    if not spans:
        return []
    start, end = min(a for a, _, _ in spans), max(b for _, b, _ in spans)
    edges = np.linspace(start, end, slices + 1)
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        overlap = [(max(0.0, min(b, hi) - max(a, lo)), f / (b - a)) for a, b, f in spans]
        width = hi - lo
        busy = sum(o for o, _ in overlap) / width
        rate = sum(o * r for o, r in overlap) / width
        rows.append({"from_s": round(lo - start, 2), "to_s": round(hi - start, 2), "rows": round(busy, 1),
                     "frames_per_s": round(rate, 1), "ms_per_step": round(1e3 * busy / rate, 2) if rate else None})
    return rows


def render_pace(rows: list[dict]) -> str:
    lines = ["| from s | to s | rows (mean) | frames/s | ms per step |", "|---|---|---|---|---|"]
    for r in rows:
        step = "-" if r["ms_per_step"] is None else f"{r['ms_per_step']:.2f}"
        lines.append(f"| {r['from_s']:.1f} | {r['to_s']:.1f} | {r['rows']:.1f} | {r['frames_per_s']:.0f} | {step} |")
    return "\n".join(lines)


def render(groups: dict[str, dict]) -> str:
    lines = ["| group | n | " + " | ".join(name for name, _, _ in STEPS) + " | batches (mean / max) |",
             "|---|---|" + "---|" * len(STEPS) + "---|"]
    for label, s in groups.items():
        cells = [f"{s['steps'][n]['p50']:.1f} / {s['steps'][n]['p95']:.1f}" if n in s["steps"] else "-"
                 for n, _, _ in STEPS]
        batches = ", ".join(f"{k} {v['mean']:g} / {v['max']}" for k, v in s["batches"].items())
        lines.append(f"| {label} | {s['n']} | " + " | ".join(cells) + f" | {batches} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--concurrency", type=int, required=True, help="The level's concurrency: its first wave's size.")
    ap.add_argument("--warmup", type=int, default=0, help="Requests before the level (ttsbench run --warmup).")
    ap.add_argument("--slices", type=int, default=10, help="Slices of time for the generation's pace.")
    ap.add_argument("--json", type=Path, help="Write the groups' summaries by label, the first wave's admissions "
                                              "under 'admissions' and the pace under 'pace'.")
    args = ap.parse_args()
    if args.slices < 1:
        raise SystemExit("--slices must be at least 1")
    waves = split_waves(load(args.log), args.concurrency, args.warmup)
    groups = {label: summarise(rs) for label, rs in waves.items() if rs}
    if not groups:
        raise SystemExit(f"{args.log}: no completed request after the warmup")
    print("  server timeline, ms p50 / p95 of each step of the first audio, then of the last chunk:")
    print(render(groups))
    admitted = admissions(waves["first wave"])
    print("  the first wave's admissions (prefill: admitted to prefilled, as the talker saw it):")
    print(render_admissions(admitted))
    rows = pace(waves["first wave"] + waves["later"], args.slices)
    print("  generation pace (each request at its mean rate from its prefill to its last frame):")
    print(render_pace(rows))
    if args.json:
        args.json.write_text(json.dumps({**groups, "admissions": admitted, "pace": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
