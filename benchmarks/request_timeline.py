"""Where the first audio of a load level's requests went inside the server: a `ttsbench serve --request-log` file.

    python benchmarks/request_timeline.py SERVER_REQUESTS.jsonl --concurrency C [--warmup W] [--json OUT.json]

After its W warmup requests, a closed-loop level sends C requests at once (the first wave) and each later
one when a stream's previous request ends; the two groups meet different servers (idle and burst-hit vs
steady), so they are summarised apart: for each step between two milestones of
serving.engine.engine.TIMELINE (the server's arrival first) the p50 / p95 / max in ms, and the batch sizes
the requests met. gpu_bench.sh writes one file per level and runs this on it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

# (name, from milestone, to milestone): the first audio's path through the server, in order
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
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    waves = split_waves(load(args.log), args.concurrency, args.warmup)
    groups = {label: summarise(rs) for label, rs in waves.items() if rs}
    if not groups:
        raise SystemExit(f"{args.log}: no completed request after the warmup")
    print("  server timeline, ms p50 / p95 of each step of the first audio:")
    print(render(groups))
    if args.json:
        args.json.write_text(json.dumps(groups, indent=1) + "\n")


if __name__ == "__main__":
    main()
