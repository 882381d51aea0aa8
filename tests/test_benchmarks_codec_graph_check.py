"""benchmarks/codec_graph_check.py on a CPU (buckets run eagerly there): split calls go through, the graph
runner agrees with the eager one, and a difference over the tolerance fails the run."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "benchmarks/codec_graph_check.py", "--device", "cpu", "--steps", "12",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_split_calls_agree_with_the_eager_runner_and_a_zero_tolerance_fails():
    run = check()
    assert run.returncode == 0, run.stdout + run.stderr
    summary = run.stdout.strip().splitlines()[-1]
    calls, split = map(int, re.match(r"(\d+) calls, (\d+) split;", summary).groups())
    assert calls == 12 and split > 0 and "-> OK" in summary
    strict = check("--no-split", "--tolerance", "0", "--verbose")
    assert strict.returncode == 1 and "-> MISMATCH" in strict.stdout and "samples off by" in strict.stdout
    assert ", 0 split;" in strict.stdout
