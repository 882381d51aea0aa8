"""The recording worker yields the CPU to the timing process: its decoding must not delay the reads whose
arrival stamps the figures come from (ttsbench/recorder.py)."""

import os

import pytest

from ttsbench.recorder import Recorder, RecordSettings
from ttsbench.storage import RunDir


@pytest.mark.skipif(not hasattr(os, "nice"), reason="no process priorities on this platform")
def test_the_recording_worker_runs_below_the_timing_process(tmp_path):
    recorder = Recorder(RunDir.create(tmp_path / "run", {}), RecordSettings())
    try:
        worker = recorder._pool.submit(os.nice, 0).result()
    finally:
        recorder.close()
    assert worker >= min(os.nice(0) + 10, 19)
