"""benchmarks/gpu_table.py over a result folder as gpu_bench.sh leaves it: the decode table and, where
decode_bench.py --split timed a frame's parts alone, where a frame's time goes (issue 7's per-frame breakdown)."""

import json
import os
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


def served_run(runs: Path, label: str, c: int, pace: list[float] | None = None, per_admission: float = 6.5) -> None:
    """A run directory as gpu_bench.sh leaves it: summary.json, and with `pace` (ms a step by slice) the
    server_timeline.json request_timeline.py writes."""
    task, set_ = label.split("-")
    run = runs / f"{label}-c{c}"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"rows": [
        {"task": task, "set": set_, "concurrency": c, "completed": 4 * c, "failed": 0, "rtf_median": 0.1,
         "audio_throughput": 3.0 * c}]}))
    if pace is not None:
        slices = [{"from_s": i * 0.5, "to_s": (i + 1) * 0.5, "rows": c - 1 - (i == len(pace) - 1) * c // 4,
                   "frames_per_s": c / ms * 1e3, "ms_per_step": ms} for i, ms in enumerate(pace)]
        (run / "server_timeline.json").write_text(json.dumps({
            "first wave": {"n": c, "steps": {}, "batches": {"prefill_batch": {"mean": c - 1.0, "max": c - 1}}},
            "later": {"n": 3 * c, "steps": {}, "batches": {"prefill_batch": {"mean": per_admission, "max": 20}}},
            "admissions": [], "pace": slices}))


def test_each_level_s_steps_through_its_time_first_median_and_slowest_slice_in_level_order(tmp_path):
    """A level whose steps slow as it goes (1.7B at 128 streams of short text, session 43) shows its first slice's
    pace against the median and slowest of its full slices (the last, the level's tail, left out), with the prompts
    an admission took after the first wave; rows come in task, set and concurrency order (c=8 before c=128), and a
    level without a timeline has no row."""
    runs = tmp_path / "runs"
    served_run(runs, "custom-short", 128, [9.4, 12.5, 16.2, 17.0, 15.9, 15.9, 9.0], per_admission=10.0)
    served_run(runs, "custom-short", 8, [5.4, 5.4, 5.6, 5.3])
    served_run(runs, "custom-long", 32)
    out = table(tmp_path)
    assert "| custom-short-c128 | 9.4 | 15.9 | 17.0 | 127 | 10.0 |" in out
    assert "| custom-short-c8 | 5.4 | 5.4 | 5.6 | 7 | 6.5 |" in out
    assert out.index("| custom-short-c8 |") < out.index("| custom-short-c128 |")
    served = out.split("## Served")[1]
    assert served.index("| custom | long | 32 |") < served.index("| custom | short | 8 |") \
        < served.index("| custom | short | 128 |")
    assert "| custom-long-c32 |" not in out.split("## Steps through each level")[1]


def test_a_served_row_without_a_decode_run_or_an_rtf_shows_a_dash_not_nan(tmp_path):
    """The floor column needs decode.json (gpu_bench's decode stage), which a serve-only run lacks: such a row
    says so with "-", as every other missing figure does; with a decode run beside it, the floor is filled in."""
    served_run(tmp_path / "runs", "custom-short", 32)
    row = next(line for line in table(tmp_path).splitlines() if line.startswith("| custom | short | 32 |"))
    assert "nan" not in row and row.split(" | ")[12] == "-" and row.split(" | ")[8] == "10.0"
    (tmp_path / "decode.json").write_text(json.dumps({"rows": [decode_row(32, 4.42)]}))
    row = next(line for line in table(tmp_path).splitlines() if line.startswith("| custom | short | 32 |"))
    assert row.split(" | ")[12] == f"{32 * 1e3 / 1.16 / 12.5:.0f}"


def test_the_machine_line_names_the_gpu_and_the_host_where_env_recorded_it(tmp_path):
    from benchmarks.gpu_table import machine_summary

    assert machine_summary(tmp_path / "env.txt") is None
    (tmp_path / "env.txt").write_text("NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04, 1980 MHz\n"
                                      "host: Intel(R) Xeon(R) Platinum 8480+, 16 CPUs, 126 GiB\n"
                                      "text vocabulary: /tmp/gpu_bench_work/qwen.tiktoken\n")
    assert ("Machine: NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04, 1980 MHz; host: Intel(R) Xeon(R) Platinum "
            "8480+, 16 CPUs, 126 GiB") in table(tmp_path)
    (tmp_path / "env.txt").write_text("NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04, 1980 MHz\n")  # before s43
    assert machine_summary(tmp_path / "env.txt").endswith("; host: not recorded")


def test_gpu_bench_s_env_stage_writes_the_host_line_the_table_reads(tmp_path):
    """The env stage's host line, run as gpu_bench.sh runs it (lscpu, nproc, /proc/meminfo), is one the machine
    line picks up."""
    script = (ROOT / "benchmarks" / "gpu_bench.sh").read_text()
    start = script.index('    echo "host:')
    command = script[start:script.index("\n", script.index('tee -a "$OUT/env.txt"', start))]
    subprocess.run(["bash", "-c", f"OUT={tmp_path}; {command}"], check=True, capture_output=True)
    (line,) = (tmp_path / "env.txt").read_text().splitlines()
    assert line.startswith("host: ") and f", {len(os.sched_getaffinity(0))} CPUs, " in line and line.endswith(" GiB")


def test_a_decode_run_with_prompt_rows_gets_what_they_add_to_the_talker_s_pass(tmp_path):
    """decode_bench.py --prompt-rows: each batch's talker pass alone and carrying each size of prompt rows, with what
    they add; a size a batch did not carry is '-'."""
    rows = [decode_row(32, 4.42) | {"prompt_length": 18, "prompt_rows_ms": {"0": 1.24, "256": 1.9, "1024": 3.75}},
            decode_row(128, 5.33) | {"prompt_length": 18, "prompt_rows_ms": {"0": 1.84, "256": 2.6}}]
    (tmp_path / "decode.json").write_text(json.dumps({"rows": rows}))
    out = table(tmp_path)
    assert "| variant | batch | prompt positions | alone | +256 rows | +1024 rows |" in out
    assert "| compile | 32 | 18 | 1.24 | 1.90 (+0.66) | 3.75 (+2.51) |" in out
    assert "| compile | 128 | 18 | 1.84 | 2.60 (+0.76) | - |" in out
    (tmp_path / "decode.json").write_text(json.dumps({"rows": [decode_row(32, 4.42)]}))
    assert "prompt rows add" not in table(tmp_path)
