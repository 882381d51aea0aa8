"""The machine's own scheduling delay, measured beside a timing test or benchmark.

A separate idle process sleeps 2 ms at a time and records how late it wakes up. Whatever delay that
process sees, any process on the machine can see too (another engineer's build, a CI neighbour), so
a timing check can tell the harness's own error from the machine's:

    with SchedulingNoise() as noise:
        ...timed work...
    noise.p99_ms, noise.max_ms
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np

_PROBE = """
import sys, time
late = []
while not sys.stdin.closed:
    t = time.perf_counter()
    time.sleep(0.002)
    late.append(time.perf_counter() - t - 0.002)
    if len(late) % 50 == 0:
        import select
        if select.select([sys.stdin], [], [], 0)[0] and not sys.stdin.read(1):
            break
print(" ".join(f"{x * 1000:.4f}" for x in late))
"""


class SchedulingNoise:
    def __init__(self):
        self.lateness_ms = np.zeros(0)
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> "SchedulingNoise":
        self._proc = subprocess.Popen([sys.executable, "-c", _PROBE], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc) -> None:
        out, _ = self._proc.communicate(timeout=30)  # closing stdin ends the probe
        self.lateness_ms = np.array([float(v) for v in out.split()])

    @property
    def p99_ms(self) -> float:
        return float(np.percentile(self.lateness_ms, 99)) if self.lateness_ms.size else 0.0

    @property
    def max_ms(self) -> float:
        """The longest delay: what any single stamp taken meanwhile may have suffered."""
        return float(self.lateness_ms.max()) if self.lateness_ms.size else 0.0
