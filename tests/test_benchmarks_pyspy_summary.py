"""benchmarks/pyspy_summary.py on a py-spy raw profile written as py-spy writes it: per thread its samples, the
active ones (parked waits left out) by the first frame of ours below the thread's loop, and a function's split."""

import subprocess
import sys
from pathlib import Path

from benchmarks import pyspy_summary

REPO = Path(__file__).resolve().parents[1]
POOL = ["Thread._bootstrap (threading.py:1030)", "Thread.run (threading.py:1010)",
        "_worker (concurrent/futures/thread.py:92)"]
ITEM = POOL + ["_WorkItem.run (concurrent/futures/thread.py:58)"]
DECODE = "CodecRunner.decode (serving/engine/codec_stage.py:248)"
LOOP = ["BaseEventLoop._run_once (asyncio/base_events.py:1987)", "Handle._run (asyncio/events.py:84)"]
STACKS = [
    ("11", "codec_0", POOL, 900),  # the pool's worker waiting for an item: parked
    ("11", "codec_0", ITEM + [DECODE, "CodecRunner._to_host (serving/engine/codec_stage.py:287)"], 70),
    ("11", "codec_0", ITEM + [DECODE, "CodecRunner._to_host (serving/engine/codec_stage.py:288)",
                              "wait_sleeping (serving/engine/cuda_graphs.py:35)"], 5),
    ("11", "codec_0", ITEM + [DECODE], 25),
    ("11", "codec_0", ITEM + [DECODE, "wait_sleeping (serving/engine/cuda_graphs.py:35)",
                              "sleep_until (serving/engine/cuda_graphs.py:41)"], 300),  # asleep, lock let go
    ("12", "talker_0", ITEM + ["Future.set_result (concurrent/futures/_base.py:540)"], 2),
    ("12", "talker_0", ITEM + ["TalkerRunner.launch (serving/engine/talker_stage.py:430)",
                               "upload (serving/model/transfer.py:13)"], 8),
    ("1", "MainThread", ["serve (ttsbench/cli.py:353)", "run_app (aiohttp/web.py:502)"] + LOOP
     + ["SpeechServer.speech (serving/api/server.py:275)", "to_pcm16 (serving/api/audio.py:40)"], 3),
    ("1", "MainThread", ["_SelectorSocketTransport.write (asyncio/selector_events.py:1075)"], 1),  # cut short
    ("13", "engine", ["BaseEventLoop.run_forever (asyncio/base_events.py:641)", LOOP[0],
                      "EpollSelector.select (selectors.py:468)"], 500),
]
RAW = "".join(f"thread ({tid}): {name};{';'.join(frames)} {n}\n" for tid, name, frames, n in STACKS)
RAW += "not a stack line\n"


def test_threads_active_samples_by_first_frame_of_ours_below_their_loop():
    stacks = pyspy_summary.parse(RAW)
    assert len(stacks) == len(STACKS)  # the line of another shape is skipped
    rows = {r["thread"]: r for r in pyspy_summary.by_thread(stacks)}
    assert list(rows) == ["codec_0", "talker_0", "MainThread", "engine"]  # most active first
    assert rows["codec_0"]["samples"] == 1300 and rows["codec_0"]["active"] == 400
    assert rows["codec_0"]["interpreter"] == 100 / 1300  # its sleeps on a CUDA event are off the interpreter
    assert rows["codec_0"]["where"] == [("CodecRunner.decode", 400)]
    assert rows["talker_0"]["where"] == [("TalkerRunner.launch", 8), ("(not ours: Future.set_result)", 2)]
    # below the event loop's turn, not the entry point of ours above it; a stack py-spy cut short keeps its leaf
    assert rows["MainThread"]["where"] == [("SpeechServer.speech", 3),
                                           ("(not ours: _SelectorSocketTransport.write)", 1)]
    assert rows["engine"]["active"] == 0 and rows["engine"]["where"] == [] and rows["engine"]["interpreter"] == 0
    # shares of the profile's time (its samples: the longest-lived thread's), not of each thread's own samples
    assert rows["MainThread"]["interpreter"] == 4 / 1300 and rows["talker_0"]["interpreter"] == 10 / 1300


def test_a_functions_samples_split_over_the_frames_below_it():
    stacks = pyspy_summary.parse(RAW)
    count, split = pyspy_summary.under(stacks, "CodecRunner.decode", depth=1)
    assert count == 400
    assert split == [("wait_sleeping (serving/engine/cuda_graphs.py:35)", 300),
                     ("CodecRunner._to_host (serving/engine/codec_stage.py:287)", 70), ("(itself)", 25),
                     ("CodecRunner._to_host (serving/engine/codec_stage.py:288)", 5)]
    assert pyspy_summary.under(stacks, "Nowhere.called") == (0, [])


def test_the_script_prints_the_table_and_refuses_a_file_without_stacks(tmp_path):
    profile = tmp_path / "pyspy.txt"
    profile.write_text(RAW)
    script = ["benchmarks/pyspy_summary.py"]
    run = subprocess.run([sys.executable, *script, str(profile), "--under", "CodecRunner.decode"], cwd=REPO,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "| codec_0 | 1300 | 400 | 0.08 | CodecRunner.decode 400 |" in run.stdout
    assert "On the interpreter, all threads: 0.09 of the profile's time" in run.stdout
    assert "CodecRunner.decode: 400 samples" in run.stdout
    empty = tmp_path / "empty.txt"
    empty.write_text("nothing here\n")
    run = subprocess.run([sys.executable, *script, str(empty)], cwd=REPO, capture_output=True, text=True)
    assert run.returncode != 0 and "no py-spy raw stacks" in run.stderr
