"""benchmarks/request_timeline.py's generation pace: rows, frames per second and ms per step over a level."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.request_timeline import admissions, pace

ROOT = Path(__file__).resolve().parents[1]


def record(arrival: float, prefilled_ms: float, last_frame_ms: float, frames: int) -> dict:
    return {"arrival": arrival, "outcome": "ok", "frames": frames,
            "ms": {"submit": 0.1, "admitted": 0.2, "prefilled": prefilled_ms, "last_frame": last_frame_ms}}


def test_pace_integrates_each_request_over_the_slices_it_spans():
    """Two requests of 100 frames over 2 s each, the second starting 1 s later: 1, 2, then 1 row generating,
    each at 50 frames/s, so 20 ms per step throughout; a faster third request shortens its slice's steps."""
    rows = pace([record(10.0, 0.0, 2000.0, 100), record(11.0, 0.0, 2000.0, 100)], slices=3)
    assert [(r["from_s"], r["to_s"]) for r in rows] == [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]
    assert [r["rows"] for r in rows] == [1.0, 2.0, 1.0]
    assert [r["frames_per_s"] for r in rows] == [50.0, 100.0, 50.0]
    assert [r["ms_per_step"] for r in rows] == [20.0, 20.0, 20.0]
    rows = pace([record(10.0, 0.0, 2000.0, 100), record(10.0, 500.0, 1000.0, 50)], slices=2)
    # slice [0, 1]: the first at 50 frames/s all of it, the second at 100 frames/s for half of it
    assert rows[0]["rows"] == 1.5 and rows[0]["frames_per_s"] == 100.0 and rows[0]["ms_per_step"] == 15.0
    assert rows[1] == {"from_s": 1.0, "to_s": 2.0, "rows": 1.0, "frames_per_s": 50.0, "ms_per_step": 20.0}


def test_pace_skips_requests_without_generated_frames():
    failed = {"arrival": 1.0, "outcome": "failed", "frames": 0, "ms": {"submit": 0.1}}
    assert pace([failed]) == []
    rows = pace([failed, record(5.0, 100.0, 1100.0, 25)], slices=1)
    assert rows == [{"from_s": 0.0, "to_s": 1.0, "rows": 1.0, "frames_per_s": 25.0, "ms_per_step": 40.0}]


def test_cli_prints_and_writes_the_pace(tmp_path):
    log = tmp_path / "server_requests.jsonl"
    lines = [record(0.0, 1.0, 50.0, 5)] + [record(1.0 + i * 0.01, 5.0, 2005.0, 50) for i in range(4)]
    for r in lines:
        r["ms"].update(first_due=10.0, first_codec_start=11.0, first_codec_end=15.0, first_taken=16.0, first_sent=17.0)
    log.write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = tmp_path / "timeline.json"
    done = subprocess.run([sys.executable, "benchmarks/request_timeline.py", str(log), "--concurrency", "2",
                           "--warmup", "1", "--slices", "4", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    assert "generation pace" in done.stdout and "ms per step" in done.stdout
    written = json.loads(out.read_text())
    assert set(written) == {"first wave", "later", "admissions", "pace"} and len(written["pace"]) == 4
    assert "first wave's admissions" in done.stdout
    assert written["admissions"] == [{"at_ms": at, "prompts": None, "running": None, "prefill_ms": 4.8}
                                     for at in (0.2, 10.2)]
    assert written["first wave"]["n"] == 2 and written["later"]["n"] == 2
    bad = subprocess.run([sys.executable, "benchmarks/request_timeline.py", str(log), "--concurrency", "2",
                          "--slices", "0"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode != 0 and "--slices must be at least 1" in bad.stderr


@pytest.mark.parametrize("slices", [1, 7])
def test_pace_slices_cover_the_span(slices):
    rows = pace([record(0.0, 0.0, 3000.0, 60), record(0.5, 0.0, 1000.0, 10)], slices=slices)
    assert len(rows) == slices and rows[0]["from_s"] == 0.0 and rows[-1]["to_s"] == 3.0


def test_admissions_lists_each_prefill_once_in_order():
    """Requests admitted together share their admitted and prefilled instants (to within the log's rounding of
    each record's times from its own arrival): one row each, in the order they began, timed from the first
    arrival."""
    def admitted(arrival, admitted_ms, prefilled_ms, prompts, running):
        return {"arrival": arrival, "outcome": "ok", "prefill_batch": prompts, "running": running,
                "ms": {"submit": 0.5, "admitted": admitted_ms, "prefilled": prefilled_ms}}
    rows = admissions([admitted(1.0, 2.0, 9.0, 1, 0), admitted(1.010, 4.0, 196.0, 2, 1),
                       admitted(1.012, 2.0, 194.0, 2, 1), {**admitted(1.012, 2.0, 194.0, 2, 1), "request_id": "b"},
                       admitted(1.0121, 1.98, 193.98, 2, 1),
                       admitted(1.020, 20.0, 40.0, 1, 3),
                       {"arrival": 1.03, "outcome": "failed", "ms": {"submit": 0.5}}])
    assert rows == [{"at_ms": 2.0, "prompts": 1, "running": 0, "prefill_ms": 7.0},
                    {"at_ms": 14.0, "prompts": 2, "running": 1, "prefill_ms": 192.0},
                    {"at_ms": 40.0, "prompts": 1, "running": 3, "prefill_ms": 20.0}]
    assert admissions([]) == []
