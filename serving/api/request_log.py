"""`ttsbench serve --request-log FILE`: one JSON line per finished speech request, saying where its time went.

The Prometheus phase histograms give means over many requests; a burst's tail needs each request's own
milestones (serving.engine.engine.TIMELINE) in ms since it arrived, beside the batch sizes it met. `arrival`
is the server's monotonic clock, which on one machine is the harness's too (requests.jsonl `t_start`), so the
two files line up. Each line is appended with the file opened for that write alone: the file may be moved away
between load levels and the next request starts a new one. The write is one os.write on an O_APPEND descriptor:
4.1 us a line on the VM against 11.3 through Path.open's text layer, which py-spy found in ~40 of the server
main thread's ~500 active samples at 128 streams of short text (H100, docs/performance.md twenty-eighth pass).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import orjson

log = logging.getLogger("serving.api")


class RequestLog:
    def __init__(self, path: Path):
        self.path = Path(path)
        try:  # an unwritable place fails at startup, not at the first request
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.touch()
        except OSError as exc:
            raise ValueError(f"--request-log {self.path}: cannot write there ({exc.strerror or exc})") from None
        self._failed = False

    def write(self, stream, arrival: float, outcome: str) -> None:
        """Append one request's line; outcome is ok, failed or cancelled. A failed write is logged once and
        never fails the request."""
        record = {
            "request_id": stream.request.request_id, "task": stream.request.task, "chars": len(stream.request.text),
            "outcome": outcome, "frames": stream.frames, "arrival": round(arrival, 6),
            "ms": {name: round((at - arrival) * 1e3, 3)
                   for name, at in sorted(stream.marks.items(), key=lambda kv: kv[1])},
            **stream.batches,
        }
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, orjson.dumps(record) + b"\n")
            finally:
                os.close(fd)
        except OSError as exc:
            if not self._failed:
                log.error("cannot write the request log %s: %s", self.path, exc)
            self._failed = True
