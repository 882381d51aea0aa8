"""The playback underrun model and the aggregation of request records, on hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest

from ttsbench import metrics


def test_underrun_none_when_audio_arrives_faster_than_real_time():
    chunks = [(0.1 + 0.05 * i, 0.1) for i in range(10)]
    assert metrics.underrun(chunks) == (0.0, 0.0)


def test_underrun_one_stall():
    # 0.4 s of audio by t=0.25 (player from 0.1 runs dry at 0.5); next audio at 1.0: 0.5 s starved
    chunks = [(0.1, 0.1), (0.15, 0.1), (0.2, 0.1), (0.25, 0.1), (1.0, 0.1), (1.05, 0.1)]
    total, worst = metrics.underrun(chunks)
    assert total == pytest.approx(0.5) and worst == pytest.approx(0.5)


def test_underrun_several_stalls_total_and_worst():
    # real-time-or-slower chunks: each 0.1 s of audio, arriving every 0.3 s -> 0.2 s starved each time
    chunks = [(0.3 * i, 0.1) for i in range(5)]
    total, worst = metrics.underrun(chunks)
    assert total == pytest.approx(0.8) and worst == pytest.approx(0.2)


def test_startup_buffer_absorbs_a_stall():
    chunks = [(0.0, 0.1), (0.3, 0.1), (0.4, 1.0)]
    assert metrics.underrun(chunks)[0] == pytest.approx(0.2)
    assert metrics.underrun(chunks, buffer_s=0.2) == (0.0, 0.0)
    # the player starts at the last arrival if the stream ends within the buffer
    assert metrics.underrun([(0.0, 0.1), (0.05, 0.1)], buffer_s=5.0) == (0.0, 0.0)


def test_the_first_starved_chunk_is_the_first_to_arrive_after_playback_ran_dry():
    # 2 frames (0.16 s) at 0.06; the second chunk at 0.29 comes after the player ran dry at 0.22
    assert metrics.first_starved_chunk([(0.06, 0.16), (0.29, 0.32), (0.48, 0.64)]) == 1
    # on time until the third: 0.1 s of audio each, every 0.05 s, then a long wait
    assert metrics.first_starved_chunk([(0.0, 0.1), (0.05, 0.1), (0.1, 0.1), (0.9, 0.1)]) == 3
    assert metrics.first_starved_chunk([(0.1 + 0.05 * i, 0.1) for i in range(10)]) is None
    assert metrics.first_starved_chunk([]) is None


def _record(i, level="c2", ok=True, ttfab=100.0, e2e=1000.0, audio=2.0, underrun=0.0, session=0, t0=0.0,
            error=None, warmup=False, chunk=None):
    return {"id": f"custom/short/{level}/{i}", "task": "custom", "set": "short", "level": level,
            "mode": "concurrency", "concurrency": int(level[1:]), "rate": None, "warmup": warmup,
            "session": session, "ok": ok, "error": error, "t_start": t0, "ttfab_ms": ttfab,
            "e2e_ms": e2e, "audio_s": audio if ok else None, "rtf": e2e / 1000 / audio if ok else None,
            "underrun_s": underrun, "max_gap_ms": 50.0, "underrun_chunk": chunk}


def test_summarize_row():
    ttfabs = [50.0, 100.0, 150.0, 250.0, 400.0]
    records = [_record(i, ttfab=t, t0=i * 0.5, underrun=0.1 if i == 1 else 0.0) for i, t in enumerate(ttfabs)]
    records.append(_record(9, ok=False, error="http_500", ttfab=None, e2e=5.0, t0=0.2))
    records.append(_record(0, warmup=True, ttfab=9999.0, t0=-10.0))
    for r in records:  # records written before underrun_chunk existed
        del r["underrun_chunk"]
    (row,) = metrics.summarize(records, metrics.SLO(ttfab_ms=200.0, underrun_s=0.0))
    assert row["completed"] == 5 and row["failed"] == 1 and row["errors"] == {"http_500": 1}
    # first send 0.0 (warmup excluded), last end 2.0 + 1.0
    assert row["duration_s"] == pytest.approx(3.0)
    assert row["request_throughput"] == pytest.approx(5 / 3.0)
    assert row["total_audio_s"] == pytest.approx(10.0)
    assert row["audio_throughput"] == pytest.approx(10 / 3.0)
    assert row["frames_per_s"] == pytest.approx(10 / 3.0 * 12.5)
    # good: ttfab < 200 and no underrun -> items 0 and 2 of 6 requests
    assert row["goodput"] == pytest.approx(2 / 6)
    assert row["ttfab_ms_mean"] == pytest.approx(np.mean(ttfabs))
    assert row["ttfab_ms_median"] == pytest.approx(150.0)
    assert row["ttfab_ms_p90"] == pytest.approx(np.percentile(ttfabs, 90))
    assert row["ttfab_ms_p99"] == pytest.approx(np.percentile(ttfabs, 99))
    assert row["ttfab_ms_max"] == 400.0
    assert row["underrun_s_max"] == pytest.approx(0.1)
    assert row["starved"] == 1 and row["starved_at_chunk"] == {}  # without underrun_chunk: counted alone


def test_a_levels_starved_requests_by_the_chunk_that_came_late():
    records = [_record(0, underrun=0.05, chunk=1), _record(1, underrun=0.02, chunk=1),
               _record(2, underrun=0.1, chunk=3), _record(3),
               _record(4, ok=False, error="timeout", underrun=0.3, chunk=2)]  # a failed one: not counted
    (row,) = metrics.summarize(records, metrics.SLO())
    assert row["starved"] == 3 and row["starved_at_chunk"] == {"1": 2, "3": 1}
    assert metrics.rows_frame([row])["starved_at_chunk"][0] == '{"1": 2, "3": 1}'  # summary.csv: a JSON cell
    (clean,) = metrics.summarize([_record(0), _record(1)], metrics.SLO())
    assert clean["starved"] == 0 and clean["starved_at_chunk"] == {}


def test_summarize_resumed_level_does_not_count_the_pause():
    records = [_record(0, t0=0.0), _record(1, t0=0.5),            # session 0: 0.0 .. 1.5
               _record(2, t0=100.0, session=1)]                   # session 1: 100.0 .. 101.0
    (row,) = metrics.summarize(records, metrics.SLO())
    assert row["duration_s"] == pytest.approx(2.5)


def test_summarize_keeps_levels_apart_and_in_order():
    records = [_record(0, level="c8"), _record(0, level="c1"), _record(1, level="c8", ok=False, error="timeout")]
    rows = metrics.summarize(records, metrics.SLO())
    assert [(r["level"], r["concurrency"], r["completed"], r["failed"]) for r in rows] == [("c8", 8, 1, 1), ("c1", 1, 1, 0)]


def test_summarize_all_failed_gives_null_statistics():
    (row,) = metrics.summarize([_record(0, ok=False, error="connect", ttfab=None)], metrics.SLO())
    assert row["completed"] == 0 and row["ttfab_ms_p99"] is None and row["goodput"] == 0.0


FULL_LOAD_KEYS = ("full_load_s", "full_load_audio_throughput", "full_load_ttfab_ms_median", "full_load_ttfab_ms_p95")


def test_full_load_figures_count_only_the_span_with_every_session_busy():
    """Closed loop at c=2: the span runs from the 2nd start (0.0) to the last start (2.0); audio counts by chunk
    arrival inside it, each chunk its share of the request's audio by bytes; TTFAB counts the requests after
    the first two (the first wave, which arrived at once), failed ones left out."""
    def rec(i, t0, e2e, chunks, audio, ttfab=None, ok=True):
        r = _record(i, t0=t0, e2e=e2e * 1000, level="c2", audio=audio, ttfab=ttfab or chunks[0][0], ok=ok)
        r["chunks"] = chunks
        return r

    records = [rec(1, 0.0, 2.0, [[100, 100], [1900, 100]], 2.0, ttfab=900.0), rec(2, 1.0, 1.0, [[100, 100], [900, 100]], 2.0),
               rec(0, 0.0, 1.0, [[100, 100], [900, 100]], 2.0, ttfab=800.0), rec(3, 2.0, 1.0, [[100, 50], [900, 150]], 4.0),
               rec(4, 2.0, 0.5, [[500, 100]], 1.0), rec(5, 1.5, 0.5, [[10, 100]], 1.0, ttfab=5.0, ok=False)]
    (row,) = metrics.summarize(records, metrics.SLO())
    assert row["full_load_s"] == pytest.approx(2.0)
    assert row["full_load_audio_throughput"] == pytest.approx(6.0 / 2.0)
    assert row["audio_throughput"] == pytest.approx(11.0 / 3.0)  # the whole level, drain included
    assert row["full_load_ttfab_ms_median"] == pytest.approx(100.0)  # 100, 100, 500: the first wave's 800, 900 out
    assert row["full_load_ttfab_ms_p95"] == pytest.approx(460.0)  # linear between 100 and 500 at 0.95
    assert row["ttfab_ms_p95"] == pytest.approx(880.0)  # the whole level: 100, 100, 500, 800, 900
    (row,) = metrics.summarize([records[0], records[2]], metrics.SLO())  # no more requests than the concurrency
    assert all(row[k] is None for k in FULL_LOAD_KEYS)
    for r in records:
        r.update(mode="rate", concurrency=None, rate=2.0)
    (row,) = metrics.summarize(records, metrics.SLO())  # open loop: no fixed number in flight
    assert all(row[k] is None for k in FULL_LOAD_KEYS)
