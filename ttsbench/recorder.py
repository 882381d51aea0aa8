"""Turns completed responses into request records, in a separate process.

Decoding, statistics, saving audio and appending to requests.jsonl cost CPU time and file I/O. In the
timing process they would hold the GIL (or the event loop) while other streams' chunks arrive and
delay their stamps: with a worker thread, completions bunching up at 128 streams delayed stamps by
~30 ms at p99. One worker process does this work instead, in submission order, so each record still
lands in requests.jsonl (flushed) right after its request completes.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import traceback
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ttsbench import decode, metrics
from ttsbench.client import RawResponse
from ttsbench.storage import RunDir


@dataclass(frozen=True)
class RecordSettings:
    pcm_sample_rate: int = decode.DEFAULT_PCM_RATE
    playback_buffer_s: float = 0.0
    save_audio: bool = True


_run: RunDir | None = None  # the worker process's view of the run directory


def _start_worker(run_path: str) -> None:
    # Ctrl-C reaches the whole process group: it stops the run, not the recording of what finished.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Below the timing process in the scheduler: on a machine with fewer free cores than busy processes (2 cores:
    # timing, recording, a local server), a completion's decoding must not take a timeslice (~20 ms) from the
    # reads, which would let a stream's next chunk arrive before the last one is read (one merged stamp).
    if hasattr(os, "nice"):
        os.nice(10)
    global _run
    _run = RunDir(Path(run_path))


def make_record(template: dict, raw: RawResponse, settings: RecordSettings, run: RunDir) -> dict:
    """The request's record: `template` (who/what was asked) plus the figures of its answer."""
    try:
        dec = decode.decode(raw, settings.pcm_sample_rate)
        figures = metrics.request_figures(raw, dec, settings.playback_buffer_s)
    except Exception:  # a harness bug must cost one record, not the run
        dec = decode.Decoded(error="other", error_detail="harness: " + traceback.format_exc(limit=3))
        figures = metrics.request_figures(raw, dec)
    audio_path = run.save_audio(template["id"], dec.wav_bytes()) if settings.save_audio and dec.data else None
    return {**template, **figures, "audio_path": audio_path}


def _record(template: dict, raw: RawResponse, settings: RecordSettings) -> bool:
    record = make_record(template, raw, settings, _run)
    _run.append(record)
    return record["ok"]


class Recorder:
    """The worker process of one run session. `close()` waits until every submitted record is written."""

    def __init__(self, run: RunDir, settings: RecordSettings):
        self.settings = settings
        # fork where there is one: instant, and it does not re-run the caller's main module as spawn does
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context(method),
                                         initializer=_start_worker, initargs=(str(run.path),))
        self._pool.submit(int).result()  # start it now, before anything is timed
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def submit(self, template: dict, raw: RawResponse, on_done: Callable[[bool], None]) -> None:
        """Record a completed request; `on_done(ok)` runs once its record is written."""
        def done(future: Future) -> None:
            if future.exception() is not None:
                with self._lock:
                    self._error = self._error or future.exception()
            else:
                on_done(future.result())
        self._pool.submit(_record, template, raw, self.settings).add_done_callback(done)

    def close(self) -> None:
        """Wait for the queued records; raise the first failure (e.g. a full disk)."""
        self._pool.shutdown(wait=True)
        if self._error is not None:
            raise OSError(f"recording requests failed: {self._error}") from self._error
