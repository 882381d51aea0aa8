"""Mean time per engine phase between two scrapes of a `ttsbench serve` /metrics (ttsbench_engine_phase_seconds).

    python benchmarks/engine_phases.py BEFORE.txt AFTER.txt [--json OUT.json]

gpu_bench.sh scrapes before and after each load level, so each level gets its own breakdown of where the time
went inside the server (serving.engine.engine.PHASES): accept, voice, queue, prefill, talker_step, first_frames,
codec_wait, codec_call, deliver; and the codec's frames: those decoded to audio and those computed for them,
padding to the captured (rows, frames) shapes included, that padding split into rows that only fill a call's
batch and chunks shorter than their call's longest; and how often the engine moved requests to lower KV slots.
Prints three lines, writes {phase: {"count", "mean_ms"}},
"codec_frames": {"decoded", "computed", "padded_share", "rows_share", "lengths_share"} (shares of computed) and
"events": {"slot_moves"} (those the server exports).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from serving.engine.codec_stage import padding_shares

_LINE = re.compile(r'^ttsbench_engine_phase_seconds_(sum|count)\{phase="([a-z_]+)"\} ([0-9.eE+-]+)$')
_CODEC = re.compile(r'^ttsbench_codec_frames_(decoded|computed|padding_rows)_total ([0-9.eE+-]+)$')
_EVENTS = re.compile(r'^ttsbench_(slot_moves)_total ([0-9.eE+-]+)$')


def parse(text: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m:
            out.setdefault(m.group(2), {})[m.group(1)] = float(m.group(3))
    return out


def counters(pattern: re.Pattern, text: str) -> dict[str, float]:
    matches = map(pattern.match, (line.strip() for line in text.splitlines()))
    return {m.group(1): float(m.group(2)) for m in matches if m}


def diff(before: str, after: str) -> dict[str, dict[str, float]]:
    a, b = parse(before), parse(after)
    result = {}
    for phase, end in b.items():
        start = a.get(phase, {})
        count = end.get("count", 0.0) - start.get("count", 0.0)
        total = end.get("sum", 0.0) - start.get("sum", 0.0)
        if count > 0:
            result[phase] = {"count": int(count), "mean_ms": round(total / count * 1e3, 2)}
    a, b = counters(_CODEC, before), counters(_CODEC, after)
    decoded, computed, rows = (b.get(k, 0.0) - a.get(k, 0.0) for k in ("decoded", "computed", "padding_rows"))
    if computed > 0:
        result["codec_frames"] = {"decoded": int(decoded), "computed": int(computed),
                                  **padding_shares(decoded, computed, rows)}
    a, b = counters(_EVENTS, before), counters(_EVENTS, after)
    if b:
        result["events"] = {k: int(v - a.get(k, 0.0)) for k, v in b.items()}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    phases = diff(args.before.read_text(), args.after.read_text())
    codec = phases.get("codec_frames")
    print("  engine phases (mean ms, n): " + ", ".join(f"{k} {v['mean_ms']:.1f} ({v['count']})"
                                                      for k, v in phases.items() if "mean_ms" in v))
    if codec:
        print(f"  codec frames: {codec['decoded']} decoded, {codec['computed']} computed "
              f"({codec['padded_share']:.1%} padding: {codec['rows_share']:.1%} rows filling a batch, "
              f"{codec['lengths_share']:.1%} chunks shorter than their call's longest)")
    if "events" in phases:
        print("  events: " + ", ".join(f"{k} {v}" for k, v in phases["events"].items()))
    if args.json:
        args.json.write_text(json.dumps(phases, indent=1) + "\n")


if __name__ == "__main__":
    main()
