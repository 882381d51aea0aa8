"""Run a script under Triton's CPU interpreter (TRITON_INTERPRET=1), in its own process: the variable is read
when triton is imported, so the test process, which may have imported it already, cannot switch it on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_interpreted(script: str) -> str:
    """The script's stdout; fails the test with its output if it exits non-zero."""
    proc = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, TRITON_INTERPRET="1"),
                          cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout
