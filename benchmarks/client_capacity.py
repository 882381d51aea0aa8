"""How many concurrent streams can `ttsbench run` read before its own timing error exceeds 2 ms?

A scripted server (tests/scripted_server.py, its own process) streams PCM to N concurrent requests on
a fixed cadence and stamps each write right before and right after it on the shared monotonic clock.
The harness runs exactly as `ttsbench run` does (runner, progress bar, recorder process writing
requests.jsonl, audio saving unless --no-save-audio). For each write, the error is the client's stamp
of the read that completed it minus the end of the server's write (0 when the stamp falls inside the
write: its bytes left then), so a coalesced or split read is charged correctly. Reported per N: p50 /
p99 / max of that error over every write (N is sustained while its p99 and those of ttfab and e2e stay
within 2 ms), the p99 measured from the start of the write instead (an
upper bound that also holds the server's own send time), the p99 of the ttfab and e2e errors, the share
of writes stamped more than 2 ms late (with kernel arrival stamps, the only way left to err is a stream
read so late that its next write had arrived too: the kernel merges them under the later stamp), the
clock that stamped the arrivals (run.json), the write rate the server achieved (at high N it falls
behind its schedule, and then writes in bursts), and the client process's CPU use (CPU seconds over
the level's wall time).

    .venv/bin/python benchmarks/client_capacity.py                      # N = 16 .. 1024, stops past 2 ms
    .venv/bin/python benchmarks/client_capacity.py --levels 64,128 --chunk-ms 40 --no-save-audio

The machine's load average is part of each record: on a shared machine, other jobs decide how often
the client gets a CPU, and a stream whose client does not run for a whole chunk interval is merged.
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


def _errors(records: list[dict], truth: dict) -> dict[str, list]:
    out = {"chunk": [], "chunk_from_start": [], "ttfab": [], "e2e": [], "first_write": [], "last_write": []}
    for r in records:
        if not r["ok"]:
            continue
        server, t0 = truth[r["text"]], r["t_start"]
        client_ends = np.cumsum([n for _, n in r["chunks"]])
        client_t = [t0 + t / 1000 for t, _ in r["chunks"]]
        written = 0
        for t_write, n, t_sent in server["writes"]:
            written += n
            t = client_t[int(np.searchsorted(client_ends, written))]  # the read that completed this write
            out["chunk"].append(max(0.0, t - t_sent) * 1000)
            out["chunk_from_start"].append((t - t_write) * 1000)
        out["first_write"].append(server["writes"][0][0])
        out["last_write"].append(server["writes"][-1][2])
        out["ttfab"].append(max(0.0, t0 + r["ttfab_ms"] / 1000 - server["writes"][0][2]) * 1000)
        out["e2e"].append(max(0.0, t0 + r["e2e_ms"] / 1000 - server["t_eof_sent"]) * 1000)
    return out


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
        runner.start_run(out, config, srv.url, None, ["benchmark"], Console(file=io.StringIO()))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        run = RunDir.open(out)
        records = run.records()
        truth = srv.entries([r["text"] for r in records if r["ok"]])
    err = _errors(records, truth)
    chunk = err["chunk"]
    return {
        "streams": n, "requests": len(records), "failed": sum(not r["ok"] for r in records),
        "writes": len(chunk), "clock": run.run_info().get("arrival_clock"),
        "chunk_err_p50_ms": float(np.percentile(chunk, 50)), "chunk_err_p99_ms": float(np.percentile(chunk, 99)),
        "chunk_err_max_ms": float(np.max(chunk)),
        "chunk_err_from_write_start_p99_ms": float(np.percentile(err["chunk_from_start"], 99)),
        "ttfab_err_p99_ms": float(np.percentile(err["ttfab"], 99)), "e2e_err_p99_ms": float(np.percentile(err["e2e"], 99)),
        "late_share": float(np.mean(np.asarray(chunk) > LIMIT_MS)),
        "scheduled_writes_per_s": n * 1000.0 / args.chunk_ms,
        "achieved_writes_per_s": len(chunk) / (max(err["last_write"]) - min(err["first_write"])),
        "client_cpu_share": cpu / wall,
        "client_cpu_us_per_chunk": cpu / len(chunk) * 1e6,
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

    print(f"client capacity: {os.cpu_count()} CPUs, {platform.platform()}, "
          f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; chunk every {args.chunk_ms} ms, "
          f"{args.chunks} chunks of {args.chunk_bytes} B per stream, save audio {args.save_audio}", flush=True)
    sustained = None
    with tempfile.TemporaryDirectory(prefix="ttsbench-capacity-") as tmp:
        for n in (int(v) for v in args.levels.split(",")):
            res = measure(n, args, Path(tmp))
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}), flush=True)
            if res["failed"] == 0 and max(res["chunk_err_p99_ms"], res["ttfab_err_p99_ms"],
                                          res["e2e_err_p99_ms"]) <= LIMIT_MS:
                sustained = n
            elif not args.keep_going:
                break
    print(f"sustained: {sustained} concurrent streams with p99 chunk, ttfab and e2e timing errors "
          f"<= {LIMIT_MS} ms")


if __name__ == "__main__":
    main()
