"""How many concurrent streams can `ttsbench run` read before its own timing error exceeds 2 ms?

A scripted server (tests/scripted_server.py, its own process) streams PCM to N concurrent requests on
a fixed cadence and stamps each write on the shared monotonic clock. The harness runs exactly as
`ttsbench run` does (runner, progress bar, requests.jsonl, audio saving unless --no-save-audio). For each
write, the error is the client's stamp of the read that completed it minus the server's stamp, so a
coalesced or split read is charged correctly. Reported per N: p50 / p99 / max of that error over
every chunk, p99 of the ttfab and e2e errors, and the client process's CPU use (its CPU seconds
over the level's wall time, and per chunk), which does not depend on what else the machine runs.

    .venv/bin/python benchmarks/client_capacity.py                      # N = 16 .. 1024, stops past 2 ms
    .venv/bin/python benchmarks/client_capacity.py --levels 64,128 --chunk-ms 40 --no-save-audio

The error includes the operating system's scheduling delay. An idle probe process measures that
delay meanwhile (tests/sched_noise.py), and "sustained beyond noise" is the largest N whose p99 error
stays within 2 ms plus the probe's p99: the client's own share. On a shared machine, record both.
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.sched_noise import SchedulingNoise  # noqa: E402
from tests.scripted_server import running  # noqa: E402
from ttsbench import runner  # noqa: E402
from ttsbench.loadgen import Level  # noqa: E402
from ttsbench.storage import RunDir  # noqa: E402

LIMIT_MS = 2.0


def _script(n_items: int, first_ms: int, chunk_ms: int, n_chunks: int, chunk_bytes: int) -> dict:
    # start offsets spread over one chunk period so the streams do not all write in the same instant
    return {f"stream {i}": {"chunks": [[first_ms + (i % chunk_ms) + k * chunk_ms, chunk_bytes]
                                       for k in range(n_chunks)]}
            for i in range(n_items)}


def _errors(records: list[dict], truth: dict) -> tuple[list, list, list]:
    chunk_err, ttfab_err, e2e_err = [], [], []
    for r in records:
        if not r["ok"]:
            continue
        server = truth[r["text"]]
        client_ends = np.cumsum([n for _, n in r["chunks"]])
        client_t = [t for t, _ in r["chunks"]]
        written = 0
        for t_write, n in server["writes"]:
            written += n
            j = int(np.searchsorted(client_ends, written))  # the read that completed this write
            chunk_err.append(client_t[j] - (t_write - r["t_start"]) * 1000)
        ttfab_err.append(r["ttfab_ms"] - (server["writes"][0][0] - r["t_start"]) * 1000)
        e2e_err.append(r["e2e_ms"] - (server["t_eof"] - r["t_start"]) * 1000)
    return chunk_err, ttfab_err, e2e_err


def measure(n: int, args, workdir: Path) -> dict:
    requests_per_level = n * args.rounds
    script = _script(requests_per_level, args.first_ms, args.chunk_ms, args.chunks, args.chunk_bytes)
    dataset = workdir / f"streams-{n}.jsonl"
    dataset.write_text("".join(json.dumps({"id": f"s{i}", "text": t, "language": "English"}) + "\n"
                               for i, t in enumerate(script)), encoding="utf-8")
    load_before = os.getloadavg()[0]
    with running(script, workdir / f"server-{n}") as srv:
        config = runner.RunConfig(tasks=["custom"], datasets=[str(dataset)], levels=[Level("concurrency", n)],
                                  num_requests=requests_per_level, warmup=0, timeout=120,
                                  save_audio=args.save_audio)
        out = workdir / f"run-{n}"
        cpu0, wall0 = time.process_time(), time.perf_counter()
        with SchedulingNoise() as noise:
            runner.start_run(out, config, srv.url, None, ["benchmark"], Console(file=io.StringIO()))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        records = RunDir.open(out).records()
        truth = srv.entries([r["text"] for r in records if r["ok"]])
    chunk_err, ttfab_err, e2e_err = _errors(records, truth)
    failed = sum(not r["ok"] for r in records)
    return {
        "streams": n, "requests": len(records), "failed": failed, "chunks": len(chunk_err),
        "chunk_err_p50_ms": float(np.percentile(chunk_err, 50)), "chunk_err_p99_ms": float(np.percentile(chunk_err, 99)),
        "chunk_err_max_ms": float(np.max(chunk_err)),
        "ttfab_err_p99_ms": float(np.percentile(ttfab_err, 99)), "e2e_err_p99_ms": float(np.percentile(e2e_err, 99)),
        "noise_p99_ms": noise.p99_ms, "noise_max_ms": noise.max_ms,
        "chunks_per_s": n * 1000.0 / args.chunk_ms, "client_cpu_share": cpu / wall,
        "client_cpu_us_per_chunk": cpu / len(chunk_err) * 1e6,
        "loadavg_1m": round(max(load_before, os.getloadavg()[0]), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--levels", default="16,32,64,128,256,512,1024", help="stream counts to try, in order")
    parser.add_argument("--first-ms", type=int, default=100)
    parser.add_argument("--chunk-ms", type=int, default=80, help="write interval of each stream")
    parser.add_argument("--chunks", type=int, default=25, help="writes per stream")
    parser.add_argument("--chunk-bytes", type=int, default=9600, help="bytes per write (9600 = 0.2 s of audio)")
    parser.add_argument("--rounds", type=int, default=2, help="requests per stream slot")
    parser.add_argument("--save-audio", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--keep-going", action="store_true", help="do not stop at the first level past 2 ms")
    args = parser.parse_args()

    console = Console()
    console.print(f"client capacity: {os.cpu_count()} CPUs, {platform.platform()}, "
                  f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; chunk every {args.chunk_ms} ms, "
                  f"{args.chunks} chunks of {args.chunk_bytes} B per stream, save audio {args.save_audio}")
    sustained = beyond_noise = None
    with tempfile.TemporaryDirectory(prefix="ttsbench-capacity-") as tmp:
        for n in (int(v) for v in args.levels.split(",")):
            res = measure(n, args, Path(tmp))
            console.print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}))
            ok = res["failed"] == 0
            if ok and res["chunk_err_p99_ms"] <= LIMIT_MS:
                sustained = n
            if ok and res["chunk_err_p99_ms"] <= LIMIT_MS + res["noise_p99_ms"]:
                beyond_noise = n
            elif not args.keep_going:
                break
    console.print(f"sustained: {sustained} concurrent streams with p99 chunk timing error <= {LIMIT_MS} ms; "
                  f"{beyond_noise} with p99 <= {LIMIT_MS} ms beyond the machine's p99 scheduling delay")


if __name__ == "__main__":
    main()
