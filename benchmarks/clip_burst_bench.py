"""A burst of voice clones' inline clips on the server's event loop: what a first wave's handlers do with them.

    python benchmarks/clip_burst_bench.py [--requests 128] [--voices 8] [--reps 5]

A closed-loop clone level sends its streams' first requests at once, each with its reference clip inline (a
base64 data: URI); the server decodes each distinct clip once and keeps it (`SpeechServer._inline_clip`). This runs
that step for --requests clips of --voices built-in voices (round-robin) at once on one event loop, the cache cold,
and prints the wall time of the burst (median of --reps, each on a fresh server) and how many decodings it ran.
The HTTP parsing before it is not included.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import statistics
import tempfile
import time
import types
from pathlib import Path

from serving.api.server import SpeechServer

VOICES = Path(__file__).resolve().parents[1] / "datasets" / "voices"


async def burst(server: SpeechServer, uris: list[str], requests: int) -> float:
    t0 = time.perf_counter()
    await asyncio.gather(*(server._inline_clip(uris[i % len(uris)]) for i in range(requests)))
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--voices", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    paths = sorted(VOICES.glob("*.wav"))[:args.voices]
    uris = ["data:audio/wav;base64," + base64.b64encode(p.read_bytes()).decode() for p in paths]
    walls, decodings = [], []
    with tempfile.TemporaryDirectory() as voices_dir:
        for _ in range(args.reps):
            server = SpeechServer(types.SimpleNamespace(stats=dict, observe=None), voices_dir=Path(voices_dir))
            count = [0]
            decode = server._decode_clip
            server._decode_clip = lambda data, param: count.__setitem__(0, count[0] + 1) or decode(data, param)
            walls.append(asyncio.run(burst(server, uris, args.requests)))
            decodings.append(count[0])
    print(f"{args.requests} clips of {len(uris)} voices at once, cold cache: {statistics.median(walls):.1f} ms median "
          f"of {args.reps} ({min(walls):.1f}-{max(walls):.1f}), {statistics.median(decodings):.0f} decodings")


if __name__ == "__main__":
    main()
