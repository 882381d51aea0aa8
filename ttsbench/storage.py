"""The run directory (docs/run-format.md): run.json, requests.jsonl, summary.json/.csv, audio/.

requests.jsonl is appended and flushed one line per completed request, so an interrupted run loses
nothing that finished; `--resume` reads it back to continue. During a run, records and audio are
written by the recorder's process (ttsbench/recorder.py), never on the timing event loop.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import warnings
from pathlib import Path

from ttsbench import metrics

FORMAT_VERSION = 1


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def default_run_dir(label: str | None) -> Path:
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return Path("runs") / (f"{stamp}-{label}" if label else stamp)


def safe_id(request_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-._" else "_" for c in request_id)


def _write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


class RunDir:
    """One run directory. Create with `RunDir.create`, reopen with `RunDir.open`."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._requests = None

    @classmethod
    def create(cls, path: Path, run_info: dict) -> "RunDir":
        path = Path(path)
        if (path / "requests.jsonl").exists():
            raise FileExistsError(f"{path} already holds a run; use --resume {path} to continue it "
                                  "or choose another --out")
        path.mkdir(parents=True, exist_ok=True)
        run = cls(path)
        run.write_run_info({"version": FORMAT_VERSION, **run_info})
        return run

    @classmethod
    def open(cls, path: Path) -> "RunDir":
        path = Path(path)
        if not (path / "run.json").is_file():
            raise FileNotFoundError(f"{path} is not a run directory (no run.json)")
        return cls(path)

    # run.json
    def run_info(self) -> dict:
        return json.loads((self.path / "run.json").read_text(encoding="utf-8"))

    def write_run_info(self, info: dict) -> None:
        _write_json_atomic(self.path / "run.json", info)

    # requests.jsonl
    def records(self) -> list[dict]:
        """Every stored request record; a line cut short by a crash is skipped with a warning."""
        path = self.path / "requests.jsonl"
        if not path.exists():
            return []
        out = []
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    warnings.warn(f"{path}:{lineno}: skipping an incomplete record")
        return out

    def append(self, record: dict) -> None:
        """Append one record line and flush it."""
        line = json.dumps(record, ensure_ascii=False) + "\n"
        if self._requests is None:
            path = self.path / "requests.jsonl"
            self._requests = path.open("a", encoding="utf-8")
            if path.stat().st_size and not _ends_with_newline(path):
                self._requests.write("\n")  # a crash cut the last line short: start a fresh one
        self._requests.write(line)
        self._requests.flush()

    def close(self) -> None:
        if self._requests is not None:
            self._requests.close()
            self._requests = None

    # audio/
    def save_audio(self, request_id: str, wav: bytes) -> str:
        """Write audio/<safe id>.wav; returns its path relative to the run directory."""
        rel = f"audio/{safe_id(request_id)}.wav"
        (self.path / "audio").mkdir(exist_ok=True)
        (self.path / rel).write_bytes(wav)
        return rel

    # summary.json / summary.csv
    def write_summary(self, slo: metrics.SLO) -> list[dict]:
        """Recompute the aggregates from requests.jsonl; quality rows already there are kept."""
        rows = metrics.summarize(self.records(), slo)
        path = self.path / "summary.json"
        summary = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        summary.update({"version": FORMAT_VERSION, "slo": slo.to_dict(), "rows": rows})
        summary.setdefault("quality", [])
        _write_json_atomic(path, summary)
        metrics.rows_frame(rows).to_csv(self.path / "summary.csv", index=False)
        return rows


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"
