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
    split = {"talker": 1.24, "code0": 0.02, "code_predictor": 3.12, "draws": 0.13}
    (tmp_path / "decode.json").write_text(json.dumps({"rows": [decode_row(32, 4.42, split)]}))
    out = table(tmp_path)
    assert "| 32 | 38 | 4.42 | 1.16 |" in out
    assert "| compile | 32 | 4.42 | 1.24 | 0.02 | 3.12 | 0.13 | 0.04 |" in out  # rest = 4.42 - 1.24 - 0.02 - 3.12


def test_a_decode_run_without_the_split_has_no_parts_table(tmp_path):
    (tmp_path / "decode.json").write_text(json.dumps({"rows": [decode_row(32, 4.42)]}))
    out = table(tmp_path)
    assert "| 32 | 38 | 4.42 |" in out and "Where a frame's time goes" not in out
