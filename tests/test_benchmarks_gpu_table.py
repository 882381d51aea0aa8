"""benchmarks/gpu_table.py over a result folder as gpu_bench.sh leaves it: the decode table and, where
decode_bench.py --split timed a frame's parts alone, where a frame's time goes (issue 7's per-frame breakdown)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def table(out: Path) -> str:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_table.py"), str(out)], check=True,
                          capture_output=True, text=True).stdout


def decode_row(batch: int, ms: float, split: dict | None = None) -> dict:
    row = {"variant": "compile", "batch": batch, "context": 38, "ms_per_frame": ms, "floor_ms": 1.16, "x_floor": 3.8,
           "frames_per_s": batch / ms * 1e3, "x_realtime_per_stream": 1e3 / ms / 12.5, "setup_s": 11.3}
    return row | ({"split_ms": split} if split else {})


def test_a_split_decode_run_gets_the_parts_table_with_the_rest_of_each_frame(tmp_path):
    split = {"talker": 1.24, "code0": 0.02, "code_predictor": 3.12, "draws": 0.13, "rest": 0.04}
    (tmp_path / "decode.json").write_text(json.dumps({"rows": [decode_row(32, 4.42, split)]}))
    out = table(tmp_path)
    assert "| 32 | 38 | 4.42 | 1.16 |" in out
    assert "| compile | 32 | 4.42 | 1.24 | 0.02 | 3.12 | 0.13 | 0.04 |" in out


def test_a_decode_run_without_the_split_has_no_parts_table(tmp_path):
    (tmp_path / "decode.json").write_text(json.dumps({"rows": [decode_row(32, 4.42)]}))
    out = table(tmp_path)
    assert "| 32 | 38 | 4.42 |" in out and "Where a frame's time goes" not in out


def test_the_gpu_clocks_line_counts_busy_samples_and_the_slowdowns_that_marked_them(tmp_path):
    """Idle samples (reason 0x1) are left out; a busy sample's SM clock counts, and a thermal or power slowdown is
    named with the number of busy samples it marked. A line nvidia-smi garbled is skipped."""
    from benchmarks.gpu_table import clocks_summary

    assert clocks_summary(tmp_path / "gpu-clocks.csv") is None
    (tmp_path / "gpu-clocks.csv").write_text(
        "timestamp, clocks.current.sm [MHz], clocks.current.memory [MHz], power.draw [W], temperature.gpu, "
        "clocks_event_reasons.active\n"
        "2026/11/27 18:49:20.423, 345 MHz, 2619 MHz, 72.18 W, 32, 0x0000000000000001\n"
        "2026/11/27 18:49:22.429, 1980 MHz, 2619 MHz, 420.00 W, 60, 0x0000000000000000\n"
        "2026/11/27 18:49:24.429, 1410 MHz, 2619 MHz, 700.00 W, 88, 0x0000000000000020\n"
        "2026/11/27 18:49:26.429, 1755 MHz, 2619 MHz, 700.00 W, 85, 0x0000000000000024\n"
        "2026/11/27 18:49:28.429, [Unknown Error]\n")
    line = clocks_summary(tmp_path / "gpu-clocks.csv")
    assert "3 busy samples" in line and "median 1755 MHz, lowest 1410" in line
    assert "software thermal in 2" in line and "power cap in 1" in line
    (tmp_path / "gpu-clocks.csv").write_text("timestamp, ...\n"
                                             "2026/11/27 18:49:20.423, 345 MHz, 2619 MHz, 72 W, 32, 0x1\n")
    assert clocks_summary(tmp_path / "gpu-clocks.csv") == "GPU clocks: no busy sample"


def test_the_table_has_the_clocks_line_when_the_run_sampled_them(tmp_path):
    (tmp_path / "decode.json").write_text(json.dumps({"rows": [decode_row(32, 4.42)]}))
    (tmp_path / "gpu-clocks.csv").write_text("timestamp, sm, mem, power, temp, reasons\n"
                                             "2026/11/27 18:49:22.429, 1980 MHz, 2619 MHz, 420 W, 60, 0x0\n")
    assert "GPU clocks (nvidia-smi every 2 s): 1 busy samples, SM clock median 1980 MHz" in table(tmp_path)
