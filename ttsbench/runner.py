"""A benchmark run: plans (task, set, level) cells, drives the load, records every request.

The CLI turns options into a RunConfig; `start_run` / `resume_run` do the rest against a server URL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import importlib.metadata
import math
import os
import platform
import random
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import ttsbench
from ttsbench import datasets, decode, metrics
from ttsbench.client import SpeechClient, combine_clocks
from ttsbench.loadgen import Level, run_level
from ttsbench.recorder import Recorder, RecordSettings
from ttsbench.requests import RequestBuilder, RequestOptions, SpeechRequest
from ttsbench.storage import RunDir, utc_now

_PACKAGES = ("ttsbench", "aiohttp", "h11", "numpy", "pandas", "soundfile", "typer", "rich")


class RunError(Exception):
    """The run cannot start (bad configuration, unreachable server); nothing was measured."""


@dataclass
class RunConfig:
    """Every option of a run; stored as run.json's `config` and read back by --resume."""
    tasks: list[str]
    sets: list[str] = field(default_factory=list)
    datasets: list[str] = field(default_factory=list)
    levels: list[Level] = field(default_factory=lambda: [Level("concurrency", 1)])
    num_requests: int | None = None
    warmup: int = 1
    request: RequestOptions = field(default_factory=RequestOptions)
    timeout: float = 300.0
    save_audio: bool = True
    seed: int = 0
    label: str | None = None
    slo: metrics.SLO = field(default_factory=metrics.SLO)
    playback_buffer_ms: float = 0.0
    pcm_sample_rate: int = decode.DEFAULT_PCM_RATE

    def to_dict(self) -> dict:
        request = dataclasses.asdict(self.request)
        mode = self.levels[0].mode
        values = [("inf" if math.isinf(lv.value) else lv.value) if mode == "rate" else int(lv.value)
                  for lv in self.levels]
        return {
            "tasks": self.tasks, "sets": self.sets, "datasets": self.datasets,
            "mode": mode, "concurrency": values if mode == "concurrency" else None,
            "request_rate": values if mode == "rate" else None,
            "num_requests": self.num_requests, "warmup": self.warmup,
            **request,
            "timeout": self.timeout, "save_audio": self.save_audio, "seed": self.seed,
            "label": self.label, "slo": self.slo.to_dict(),
            "playback_buffer_ms": self.playback_buffer_ms, "pcm_sample_rate": self.pcm_sample_rate,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        if d["mode"] == "rate":
            levels = [Level("rate", float(v)) for v in d["request_rate"]]
        else:
            levels = [Level("concurrency", int(v)) for v in d["concurrency"]]
        request_keys = {f.name for f in dataclasses.fields(RequestOptions)}
        return cls(
            tasks=d["tasks"], sets=d["sets"], datasets=d["datasets"], levels=levels,
            num_requests=d["num_requests"], warmup=d["warmup"],
            request=RequestOptions(**{k: d[k] for k in request_keys if k in d}),
            timeout=d["timeout"], save_audio=d["save_audio"], seed=d["seed"], label=d["label"],
            slo=metrics.SLO(**d["slo"]), playback_buffer_ms=d["playback_buffer_ms"],
            pcm_sample_rate=d["pcm_sample_rate"])


@dataclass(frozen=True)
class _Job:
    """One request of a cell; `index` drives the round-robin over speakers, designs and voices."""
    id: str
    index: int
    warmup: bool
    item: datasets.Item


@dataclass(frozen=True)
class _Cell:
    """One (task, set, level) and its progress bar."""
    builder: RequestBuilder
    set_name: str
    level: Level
    bar: int


def load_sets(config: RunConfig) -> list[tuple[str, list[datasets.Item]]]:
    """(name, items) for the built-in sets, then the user files (named by their stem)."""
    sets = [(name, datasets.load_set(name)) for name in config.sets]
    for path in config.datasets:
        sets.append((Path(path).stem, datasets.load_items(Path(path), strict=False)))
    names = [name for name, _ in sets]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise RunError(f"two sets are named {', '.join(duplicates)}; rename a --dataset file")
    return sets


def _host_info() -> dict:
    return {"hostname": socket.gethostname(), "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "python": sys.version.split()[0]}


def _packages() -> dict:
    out = {}
    for name in _PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _first_model(models: dict | None) -> str | None:
    body = (models or {}).get("body")
    data = body.get("data") if isinstance(body, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict):
        return data[0].get("id")
    return None


class _Session:
    """One `ttsbench run` (or `--resume`) invocation against a run directory."""

    def __init__(self, run: RunDir, config: RunConfig, base_url: str, api_key: str | None,
                 console: Console, session: int, recorder: Recorder):
        self.run, self.config, self.console, self.session = run, config, console, session
        self.recorder = recorder
        self.client = SpeechClient(base_url, api_key, config.timeout)
        records = run.records()
        self.done_ids = {r["id"] for r in records}
        self.warmups_done: dict[str, int] = {}
        for r in records:
            if r.get("warmup"):
                cell = r["id"].rsplit("/", 1)[0]
                self.warmups_done[cell] = self.warmups_done.get(cell, 0) + 1
        self.progress: Progress | None = None
        self.failed: dict[int, int] = {}  # progress bar -> failed requests

    def _template(self, cell: _Cell, job: _Job, req: SpeechRequest) -> dict:
        """The record's fields that say what was asked; the recorder adds what came back."""
        level = cell.level
        return {
            "id": job.id, "item_id": req.item.id, "task": cell.builder.task, "set": cell.set_name,
            "language": self.config.request.language or req.item.language, "text": req.item.text,
            "voice": req.voice, "instructions": req.instructions,
            "ref_audio_path": req.ref_audio_path, "ref_text": req.ref_text,
            "mode": level.mode, "level": level.name, "concurrency": level.concurrency,
            "rate": level.rate, "warmup": job.warmup, "stream": self.config.request.stream,
            "session": self.session,
        }

    async def _send(self, cell: _Cell, job: _Job) -> None:
        # Built here rather than up front: a clone body carries its reference clip (~0.3 MB).
        req = cell.builder.build(job.item, job.index)
        raw = await self.client.speech(req.body)

        def recorded(ok: bool) -> None:  # on the recorder's callback thread
            if not job.warmup:
                self.failed[cell.bar] += not ok
                self.progress.update(cell.bar, advance=1, failed=self.failed[cell.bar])

        self.recorder.submit(self._template(cell, job, req), raw, recorded)

    def _warmups(self, builder: RequestBuilder) -> int:
        """Unmeasured requests before a level: --warmup, and for voice clone that resends its voices (inline or
        uploaded) at least one per voice, consecutive indices taking each voice in turn. A server encodes a voice
        the first time it meets it; without this a level's first wave would wait on the encodings of the voices
        that no earlier level happened to send, so its figures would depend on which levels ran before it.
        --clone-mode fresh measures new voices; --warmup 0 sends none."""
        n = self.config.warmup
        if n and builder.task == "clone" and self.config.request.clone_mode != "fresh":
            n = max(n, len(builder.voices))
        return n

    async def _cell(self, builder: RequestBuilder, set_name: str, order: list, level: Level) -> None:
        cfg = self.config
        n = cfg.num_requests or level.default_requests()
        prefix = f"{builder.task}/{set_name}/{level.name}"
        todo = [i for i in range(n) if f"{prefix}/{i}" not in self.done_ids]
        if not todo:
            return
        w0 = self.warmups_done.get(prefix, 0)  # a resumed cell warms up again, under new ids
        warm = [_Job(f"{prefix}/warmup-{w0 + i}", n + i, True, order[(n + i) % len(order)])
                for i in range(self._warmups(builder))]
        jobs = [_Job(f"{prefix}/{i}", i, False, order[i % len(order)]) for i in todo]
        bar = self.progress.add_task(prefix, total=len(jobs), failed=0, phase="warmup" if warm else "")
        self.failed[bar] = 0
        cell = _Cell(builder, set_name, level, bar)

        async def send(job: _Job) -> None:
            await self._send(cell, job)

        await run_level(level, warm, send, cfg.seed)
        self.progress.update(bar, phase="")
        await run_level(level, jobs, send, cfg.seed)

    async def execute(self, sets: list[tuple[str, list[datasets.Item]]]) -> None:
        cfg = self.config
        columns = (TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[failed]} failed"), TextColumn("{task.fields[phase]}"),
                   TimeElapsedColumn())
        # Few refreshes: the progress display shares the process with the timed client.
        with Progress(*columns, console=self.console, refresh_per_second=2) as progress:
            self.progress = progress
            for task in cfg.tasks:
                builder = RequestBuilder(task, cfg.request)
                if task == "clone" and cfg.request.clone_mode == "upload":
                    for voice in builder.voices:
                        try:
                            await self.client.upload_voice(voice)
                        except Exception as e:
                            raise RunError(f"--clone-mode upload: {e}") from e
                for set_name, items in sets:
                    order = list(items)
                    random.Random(f"{cfg.seed}:{set_name}").shuffle(order)
                    for level in cfg.levels:
                        await self._cell(builder, set_name, order, level)


async def _probe(base_url: str, api_key: str | None) -> dict:
    try:
        async with SpeechClient(base_url, api_key) as client:
            models, health = await client.get_json("/v1/models"), await client.get_json("/health")
    except ValueError as e:  # the URL itself
        raise RunError(f"--url: {e}") from None
    if models.get("status") is None and health.get("status") is None:
        raise RunError(f"cannot reach the server at {base_url}: {models.get('error')}")
    return {"models": models, "health": health}


def _run_session(run: RunDir, config: RunConfig, sets, base_url: str, api_key: str | None,
                 console: Console, session: int) -> list[dict]:
    """Run the planned cells; on any end, including Ctrl-C, write the summary of what completed."""
    recorder = Recorder(run, RecordSettings(config.pcm_sample_rate, config.playback_buffer_ms / 1000.0,
                                            config.save_audio))
    sess = _Session(run, config, base_url, api_key, console, session, recorder)

    async def main() -> None:
        async with sess.client:
            await sess.execute(sets)

    # The recorder's feeder and callback threads and the progress display share the GIL with the event
    # loop; a short switch interval (default 5 ms) hands it back to the loop soon after a chunk arrives.
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    # A full pass of the cyclic GC over everything imported (numpy, pandas, rich) stops the event loop
    # for 30-70 ms, long enough for a stream's next chunk to merge with the unread one in the socket
    # (one arrival stamp for both). Frozen objects are skipped; the GC still sees what the run creates.
    gc.collect()
    gc.freeze()
    try:
        asyncio.run(main())
    finally:
        gc.unfreeze()
        sys.setswitchinterval(switch_interval)
        recorder.close()
        rows = run.write_summary(config.slo)
    info = run.run_info()
    info["finished_at"] = utc_now()
    info["sessions"][-1]["finished_at"] = info["finished_at"]
    info["arrival_clock"] = combine_clocks([info.get("arrival_clock"), sess.client.arrival_clock])
    run.write_run_info(info)
    return rows


def start_run(out: Path, config: RunConfig, base_url: str, api_key: str | None, command: list[str],
              console: Console, embedded_server: dict | None = None) -> list[dict]:
    """A new run into `out`. Returns the summary rows."""
    sets = load_sets(config)
    for task in config.tasks:
        RequestBuilder(task, config.request)  # fail on missing inputs before anything is sent
    server = asyncio.run(_probe(base_url, api_key))
    if config.request.model is None:
        config.request = dataclasses.replace(config.request, model=_first_model(server["models"]))
    started = utc_now()
    run = RunDir.create(out, {
        "ttsbench_version": ttsbench.__version__, "command": command, "label": config.label,
        "url": base_url, "embedded_server": embedded_server, "server": server,
        "config": config.to_dict(), "host": _host_info(), "packages": _packages(),
        "started_at": started, "finished_at": None, "arrival_clock": None,
        "sessions": [{"started_at": started, "finished_at": None, "command": command}],
    })
    console.print(f"run directory: {run.path}")
    return _run_session(run, config, sets, base_url, api_key, console, 0)


def resume_run(path: Path, base_url: str, api_key: str | None, command: list[str],
               console: Console) -> list[dict]:
    """Continue an interrupted run with its stored configuration; finished requests are kept."""
    run = RunDir.open(path)
    info = run.run_info()
    config = RunConfig.from_dict(info["config"])
    sets = load_sets(config)
    asyncio.run(_probe(base_url, api_key))
    sessions = info.setdefault("sessions", [])
    sessions.append({"started_at": utc_now(), "finished_at": None, "command": command, "url": base_url})
    info["finished_at"] = None
    run.write_run_info(info)
    console.print(f"resuming {run.path}: {len(run.records())} requests already recorded")
    return _run_session(run, config, sets, base_url, api_key, console, len(sessions) - 1)


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def summary_table(rows: list[dict]) -> Table:
    """The end-of-run table; print it with `print_summary` so it is not squeezed in a pipe."""
    table = Table(title="ttsbench summary")
    for name in ("task/set/level", "ok", "fail", "req/s", "audio xRT", "full-load xRT", "TTFAB p50", "TTFAB p99",
                 "E2E p50", "RTF p50", "underrun p99", "starved", "goodput"):
        table.add_column(name, justify="left" if name == "task/set/level" else "right", no_wrap=True)
    for r in rows:
        table.add_row(f"{r['task']}/{r['set']}/{r['level']}", str(r["completed"]), str(r["failed"]),
                      _fmt(r["request_throughput"], 2), _fmt(r["audio_throughput"], 2),
                      _fmt(r.get("full_load_audio_throughput"), 2),
                      _fmt(r["ttfab_ms_median"]), _fmt(r["ttfab_ms_p99"]), _fmt(r["e2e_ms_median"]),
                      _fmt(r["rtf_median"], 3), _fmt(r["underrun_s_p99"], 3), str(r.get("starved", "-")),
                      f"{r['goodput'] * 100:.0f}%")
    table.caption = ("times in ms, underrun in s; xRT: audio seconds per second (full-load: while every concurrent "
                     "request was in flight); starved: completed requests whose playback ran dry; goodput: share "
                     "of requests meeting the SLO")
    return table


def print_summary(console: Console, rows: list[dict]) -> None:
    if not console.is_terminal and console.width < 160:  # a pipe or log file: do not squeeze columns
        console = Console(file=console.file, width=160)
    console.print(summary_table(rows))
