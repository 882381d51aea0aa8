"""The project's own CI gate: a tiny benchmark of the embedded reference server (tiny random checkpoint on
the CPU) judged against the committed baseline reports/baselines/cpu-tiny.json under
reports/baselines/ci-rules.toml (generous timing tolerances: CI machines are noisy).

The benchmark reruns the very command the baseline was made with (kept in the baseline's provenance), so
the two cannot drift apart. After an intended change of the figures, refresh the baseline with that
command (`--out runs/cpu-tiny-baseline`) and `ttsbench baseline runs/cpu-tiny-baseline -o
reports/baselines/cpu-tiny.json`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BASELINE = REPO / "reports" / "baselines" / "cpu-tiny.json"
RULES = REPO / "reports" / "baselines" / "ci-rules.toml"
ARTIFACTS = REPO / "test-artifacts"


def ttsbench(*args, timeout: float = 120.0) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("ttsbench")
    return subprocess.run([str(exe), *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_ci_gate_on_the_cpu_reference_server(tmp_path):
    source = json.loads(BASELINE.read_text())["source"]
    command = list(source["command"])
    assert command[:2] == ["ttsbench", "run"] and "--url" not in command    # the embedded server
    assert source["embedded_server"]["model"].startswith("tiny-random")
    assert source["embedded_server"]["engine"]["ignore_eos"]     # lengths exact: the total_audio_s rule holds
    command[command.index("--out") + 1] = str(tmp_path / "run")

    run = ttsbench(*command[1:], timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    ARTIFACTS.mkdir(exist_ok=True)
    gate = ttsbench("gate", "--baseline", BASELINE, "--current", tmp_path / "run", "--rules", RULES)
    report = ttsbench("report", BASELINE, tmp_path / "run", "-o", ARTIFACTS / "ci-gate-report.html")
    (ARTIFACTS / "ci-gate.txt").write_text(gate.stdout + gate.stderr)
    assert report.returncode == 0, report.stderr
    assert gate.returncode == 0, gate.stdout + gate.stderr
    assert "PASS" in gate.stdout and "custom/short/c2" in gate.stdout
