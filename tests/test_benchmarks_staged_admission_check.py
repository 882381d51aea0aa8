"""benchmarks/staged_admission_check.py on a CPU: without wide layers the staged admission's passes follow the step
and leave exactly the reference's state; with them (Triton's interpreter) the prompt rows ride the step and land
within float32 rounding of it, and a tolerance of 0 fails the run."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def check(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "benchmarks/staged_admission_check.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, **env))


def figures(stdout: str) -> list[float]:
    line = stdout.strip().splitlines()[-1]
    return [float(x) for x in re.findall(r"(?:hidden|values) ([0-9.e+-]+)", line)]


def test_passes_after_the_step_leave_the_reference_state():
    run = check()
    assert run.returncode == 0, run.stdout + run.stderr
    assert "prompt rows carried: none, passes after the step" in run.stdout and "-> OK" in run.stdout
    assert figures(run.stdout) == [0.0, 0.0, 0.0]


@pytest.mark.slow
def test_prompt_rows_in_the_step_land_within_rounding_and_a_zero_tolerance_fails():
    pytest.importorskip("triton", reason="triton is a test dependency (scripts/setup.sh --test installs it)")
    run = check("--force-triton", "--tolerance", "0", TRITON_INTERPRET="1")
    assert run.returncode == 1 and "-> MISMATCH" in run.stdout, run.stdout + run.stderr
    assert "prompt rows carried: 256" in run.stdout
    diffs = figures(run.stdout)
    assert len(diffs) == 3 and max(diffs) < 1e-4 and max(diffs) > 0
