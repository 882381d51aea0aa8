"""One markdown table of a benchmarks/gpu_bench.sh result folder: decode by batch, served load levels, peers.

    python benchmarks/gpu_table.py OUT_DIR [RUNS_DIR]

Reads OUT_DIR/decode.json, RUNS_DIR/*/summary.json, engine_phases.json and server_timeline.json (default
OUT_DIR/runs), OUT_DIR/env.txt, gpu-clocks.csv and peer-*.json. The floor
of a served row is the decode floor at the nearest measured batch: frames per second the HBM allows at that
batch (rows x copy bandwidth / bytes per frame), as audio seconds per second.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FPS = 12.5


def decode_rows(out: Path) -> list[dict]:
    path = out / "decode.json"
    return json.loads(path.read_text())["rows"] if path.exists() else []


def floor_audio_per_s(decode: list[dict], concurrency: int) -> float | None:
    """Audio seconds per second at the HBM floor for `concurrency` streams (nearest measured batch)."""
    rows = [r for r in decode if r["variant"] == decode[0]["variant"]] if decode else []
    if not rows:
        return None
    nearest = min(rows, key=lambda r: abs(r["batch"] - concurrency))
    return concurrency * 1e3 / nearest["floor_ms"] / FPS


def padding(codec: dict | None) -> str:
    """A level's codec padding: the share of frames computed that no one hears, and its two parts (rows that
    only fill a call's batch + chunks shorter than their call's longest) where the server counted them."""
    if codec is None:
        return "-"
    if "rows_share" not in codec:
        return f"{codec['padded_share']:.1%}"
    return f"{codec['padded_share']:.1%} ({codec['rows_share']:.1%} + {codec['lengths_share']:.1%})"


SLOWDOWNS = {0x4: "power cap", 0x8: "hardware slowdown", 0x20: "software thermal", 0x40: "hardware thermal",
             0x80: "power brake"}  # nvidia-smi's clocks event reasons that slow a busy GPU (0x1 is "idle")


def clocks_summary(path: Path) -> str | None:
    """One line on the GPU's clocks through a run, from nvidia-smi's CSV (gpu_bench.sh's gpu-clocks.csv): the SM
    clock over the busy samples (those not flagged idle) and how many of them a power or thermal slowdown marked.
    A run whose figures sit far below its peers' on a machine whose clocks sagged is the machine's, not the code's."""
    if not path.exists():
        return None
    busy, slowed = [], {}
    for line in path.read_text().splitlines()[1:]:
        cells = [c.strip() for c in line.split(",")]
        try:
            sm, reasons = float(cells[1].split()[0]), int(cells[5], 16)
        except (IndexError, ValueError):
            continue
        if reasons & 0x1:
            continue
        busy.append(sm)
        for bit, name in SLOWDOWNS.items():
            if reasons & bit:
                slowed[name] = slowed.get(name, 0) + 1
    if not busy:
        return "GPU clocks: no busy sample"
    busy.sort()
    marks = ", ".join(f"{name} in {n}" for name, n in slowed.items()) or "none"
    return (f"GPU clocks (nvidia-smi every 2 s): {len(busy)} busy samples, SM clock median {busy[len(busy) // 2]:.0f}"
            f" MHz, lowest {busy[0]:.0f}; slowdowns: {marks}")


def level_order(path: Path) -> tuple:
    """A run directory (TASK-SET-cC, as gpu_bench.sh names them) in the served table's order: task, set, C."""
    name, _, c = path.parent.name.rpartition("-c")
    return (name, int(c)) if c.isdigit() else (path.parent.name, 0)


def pace_summary(timeline: dict) -> str | None:
    """A level's steps through its time (request_timeline.py's pace, in slices of the level) as one table row's
    cells: ms a step in the first slice, the median slice and the slowest full one (the last slice is the
    level's tail, few rows), the rows they ran, and the prompts an admission took after the first wave. A level
    whose steps slow as it goes (session 43: 1.7B, 128 streams of short text, 9.4 ms a step in its first slice,
    ~16 from the fourth on, with admissions half as frequent and half again as large) shows it here, where its
    throughput alone does not say whether the steps or the machine's start did it."""
    slices = timeline.get("pace") or []
    if not slices:
        return None
    full = slices[:-1] or slices
    steps = sorted(s["ms_per_step"] for s in full)
    later = timeline.get("later", {}).get("batches", {}).get("prefill_batch", {})
    per_admission = f"{later['mean']:.1f}" if "mean" in later else "-"
    return (f"{slices[0]['ms_per_step']:.1f} | {steps[len(steps) // 2]:.1f} | {steps[-1]:.1f} | "
            f"{sum(s['rows'] for s in full) / len(full):.0f} | {per_admission}")


def machine_summary(path: Path) -> str | None:
    """One line on the machine from gpu_bench.sh's env.txt: the GPU (name, memory, driver, top SM clock) and the
    host's CPU. The server's loop, its talker thread's launches and the client all run on the host, so a slower
    host slows the levels of many streams while the GPU's clocks look the same (session 43)."""
    if not path.exists():
        return None
    lines = path.read_text().splitlines()
    host = next((line for line in lines if line.startswith("host:")), "host: not recorded")
    return f"Machine: {lines[0] if lines else '?'}; {host}"


def main() -> None:
    out = Path(sys.argv[1])
    runs = Path(sys.argv[2]) if len(sys.argv) > 2 else out / "runs"
    decode = decode_rows(out)
    if decode:
        print("## Decode: ms per frame (talker + 15 code-predictor passes + 16 draws, codes on the host)\n")
        variants = list(dict.fromkeys(r["variant"] for r in decode))
        print("| batch | context | " + " | ".join(f"{v} ms" for v in variants) + " | floor ms | best x floor | "
              "best x real time per stream | best audio s/s |")
        print("|---" * (len(variants) + 6) + "|")
        for b in sorted({r["batch"] for r in decode}):
            by = {r["variant"]: r for r in decode if r["batch"] == b}
            best = min(by.values(), key=lambda r: r["ms_per_frame"])
            print(f"| {b} | {best['context']} | " + " | ".join(f"{by[v]['ms_per_frame']:.2f}" if v in by else "-"
                                                             for v in variants)
                  + f" | {best['floor_ms']:.2f} | {best['x_floor']:.1f} | {best['x_realtime_per_stream']:.1f} | "
                  f"{b * best['x_realtime_per_stream']:.0f} |")
        print()
        split = [r for r in decode if "split_ms" in r]
        if split:
            print("## Where a frame's time goes: each part alone as a graph of its own (decode_bench.py --split), ms\n")
            print("| variant | batch | frame | talker | code 0 | code predictor (15 passes) | of which the 16 draws "
                  "| rest |")
            print("|---" * 8 + "|")
            for r in split:
                p = r["split_ms"]
                rest = f"{p['rest']:.2f}" if "rest" in p else "-"  # session 42's raw decode.json has none
                print(f"| {r['variant']} | {r['batch']} | {r['ms_per_frame']:.2f} | {p['talker']:.2f} | "
                      f"{p['code0']:.2f} | {p['code_predictor']:.2f} | {p['draws']:.2f} | {rest} |")
            print()
        carried = [r for r in decode if "prompt_rows_ms" in r]
        if carried:
            sizes = sorted({int(n) for r in carried for n in r["prompt_rows_ms"]} - {0})
            print("## What an admission's prompt rows add to the talker's pass (decode_bench.py --prompt-rows), ms\n")
            print("| variant | batch | prompt positions | alone | " + " | ".join(f"+{n} rows" for n in sizes) + " |")
            print("|---" * (4 + len(sizes)) + "|")
            for r in carried:
                ms = r["prompt_rows_ms"]
                alone = ms["0"]
                print(f"| {r['variant']} | {r['batch']} | {r['prompt_length']} | {alone:.2f} | "
                      + " | ".join(f"{ms[str(n)]:.2f} (+{ms[str(n)] - alone:.2f})" if str(n) in ms else "-"
                                   for n in sizes) + " |")
            print()
    summaries = sorted(runs.glob("*/summary.json"), key=level_order) if runs.exists() else []
    if summaries:
        print("## Served (ttsbench run over loopback, streaming PCM)\n")
        print("| task | set | c | ok | failed | TTFAB p50 ms | TTFAB p95 ms | RTF p50 | x real time per stream p50 | "
              "full-load TTFAB p50 / p95 ms | audio s/s | full-load audio s/s | floor audio s/s | underrun p95 s | E2E p50 ms |")
        print("|---" * 15 + "|")
        rows = []
        for path in summaries:
            for r in json.loads(path.read_text())["rows"]:
                rows.append(r)
        rows.sort(key=lambda r: (r["task"], r["set"], r["concurrency"] or 0))
        for r in rows:
            def f(key, fmt="{:.1f}"):
                return fmt.format(r[key]) if r.get(key) is not None else "-"
            rtf = r.get("rtf_median")
            floor = floor_audio_per_s(decode, r["concurrency"] or 1)
            speed = f"{1 / rtf:.1f}" if rtf else "-"
            floor_cell = f"{floor:.0f}" if floor else "-"
            print(f"| {r['task']} | {r['set']} | {r['concurrency']} | {r['completed']} | {r['failed']} | "
                  f"{f('ttfab_ms_median')} | {f('ttfab_ms_p95')} | {f('rtf_median', '{:.3f}')} | "
                  f"{speed} | {f('full_load_ttfab_ms_median')} / {f('full_load_ttfab_ms_p95')} | "
                  f"{f('audio_throughput')} | {f('full_load_audio_throughput')} | "
                  f"{floor_cell} | {f('underrun_s_p95', '{:.3f}')} | {f('e2e_ms_median', '{:.0f}')} |")
        print()
        phased = [(path.parent.name, json.loads((path.parent / "engine_phases.json").read_text()))
                  for path in summaries if (path.parent / "engine_phases.json").exists()]
        if phased:
            print("## Inside the server: mean ms per engine phase (benchmarks/engine_phases.py; count in brackets)\n")
            from serving.engine.engine import PHASES

            names = tuple(PHASES)
            events = ("slot_moves",)
            print("| run | " + " | ".join(names) + " | codec padding (rows + lengths) | " + " | ".join(events) + " |")
            print("|---" * (len(names) + 2 + len(events)) + "|")
            for label, phases in phased:
                counted = phases.get("events", {})
                print(f"| {label} | " + " | ".join(f"{phases[n]['mean_ms']:.1f} ({phases[n]['count']})" if n in phases
                                                   else "-" for n in names)
                      + f" | {padding(phases.get('codec_frames'))} | "
                      + " | ".join(str(counted[e]) if e in counted else "-" for e in events) + " |")
            print()
        paced = [(path.parent.name, pace_summary(json.loads((path.parent / "server_timeline.json").read_text())))
                 for path in summaries if (path.parent / "server_timeline.json").exists()]
        paced = [(label, cells) for label, cells in paced if cells]
        if paced:
            print("## Steps through each level (benchmarks/request_timeline.py's pace: the level in slices of time)\n")
            print("| run | ms a step, first slice | median slice | slowest slice | rows (mean) | "
                  "prompts an admission (after the first wave) |")
            print("|---" * 6 + "|")
            for label, cells in paced:
                print(f"| {label} | {cells} |")
            print()
    for line in (machine_summary(out / "env.txt"), clocks_summary(out / "gpu-clocks.csv")):
        if line:
            print(line + "\n")
    peers = sorted(out.glob("peer-*.json"))
    if peers:
        print("## Peers, batch 1, same GPU (peer-bench recipe: 125 frames, 40 text tokens, random weights)\n")
        print("| implementation | ms per frame | x real time (generate + decode) | first audio ms |")
        print("|---|---|---|---|")
        for path in peers:
            d = json.loads(path.read_text())
            if "fast" in d:
                fast = d["fast"]
                ttfa = fast.get("stream_chunk8", {}).get("ttfa_s", {}).get("median")
                print(f"| faster-qwen3-tts {fast.get('version')} | {fast['ms_per_frame_step']:.1f} | "
                      f"{fast['rtf_generate_plus_decode']:.2f} | {ttfa * 1e3 if ttfa else float('nan'):.0f} (chunk 8) |")
            if "official" in d and "B1" in d["official"]:
                b1 = d["official"]["B1"]
                print(f"| official qwen-tts {d.get('qwen-tts')} | {b1['ms_per_frame_step']:.1f} | "
                      f"{b1['rtf_generate_plus_decode']:.2f} | no streaming |")


if __name__ == "__main__":
    main()
