"""benchmarks/codec_graph_check.py on a CPU (buckets run eagerly there): calls of mixed chunk lengths go through,
the graph runner agrees with the eager one, and a difference over the tolerance fails the run."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "benchmarks/codec_graph_check.py", "--device", "cpu", "--steps", "12",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_the_graph_runner_agrees_with_the_eager_one_and_a_zero_tolerance_fails():
    run = check()
    assert run.returncode == 0, run.stdout + run.stderr
    summary = run.stdout.strip().splitlines()[-1]
    samples, states = map(float, re.search(r"samples ([0-9.e+-]+), slot states ([0-9.e+-]+) -> OK", summary).groups())
    assert summary.startswith("12 calls;") and 0 < samples <= 1e-2 and states <= 1e-2
    strict = check("--tolerance", "0", "--verbose")
    assert strict.returncode == 1 and "-> MISMATCH" in strict.stdout and "samples off by" in strict.stdout
