"""Load patterns: closed loop at a fixed concurrency, or open loop with Poisson arrivals at a rate.

The generator only decides when each job starts; `send(job)` does the request and its bookkeeping.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence, TypeVar

Job = TypeVar("Job")


@dataclass(frozen=True)
class Level:
    """One load level: `concurrency` (closed loop) or `rate` requests/s (open loop; inf = all at once)."""
    mode: str
    value: float

    @property
    def name(self) -> str:
        if self.mode == "concurrency":
            return f"c{int(self.value)}"
        return "rinf" if math.isinf(self.value) else f"r{self.value:g}"

    @property
    def concurrency(self) -> int | None:
        return int(self.value) if self.mode == "concurrency" else None

    @property
    def rate(self) -> float | None:
        return self.value if self.mode == "rate" and not math.isinf(self.value) else None

    def default_requests(self) -> int:
        """Enough for stable percentiles: 4 per concurrency slot (or per second of rate), at least 10."""
        if self.mode == "rate" and math.isinf(self.value):
            return 32
        return max(10, math.ceil(4 * self.value))


def parse_levels(concurrency: str | None, rate: str | None) -> list[Level]:
    """Levels from `--concurrency 1,8,32` or `--request-rate 0.5,2,inf` (one of the two)."""
    if concurrency and rate:
        raise ValueError("give --concurrency or --request-rate, not both")
    if rate:
        levels = []
        for part in rate.split(","):
            try:
                value = float(part)
            except ValueError:
                raise ValueError(f"--request-rate: {part.strip()!r} is not a number or 'inf'") from None
            if not value > 0:
                raise ValueError(f"--request-rate: {part.strip()!r} must be > 0")
            levels.append(Level("rate", value))
        return levels
    levels = []
    for part in (concurrency or "1").split(","):
        if not part.strip().isdigit() or int(part) < 1:
            raise ValueError(f"--concurrency: {part.strip()!r} is not a positive integer")
        levels.append(Level("concurrency", int(part)))
    return levels


async def _closed_loop(jobs: Sequence[Job], concurrency: int, send: Callable[[Job], Awaitable[None]]) -> None:
    queue = iter(jobs)

    async def worker() -> None:
        for job in queue:  # one shared iterator: each job goes to the first free worker
            await send(job)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(jobs)))))


async def _open_loop(jobs: Sequence[Job], rate: float, send: Callable[[Job], Awaitable[None]],
                     seed: int) -> None:
    loop = asyncio.get_running_loop()
    rng = random.Random(seed)
    t0 = loop.time()
    offset, tasks = 0.0, []
    for i, job in enumerate(jobs):
        if i and not math.isinf(rate):
            offset += rng.expovariate(rate)
        delay = t0 + offset - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(send(job)))
    await asyncio.gather(*tasks)


async def run_level(level: Level, jobs: Sequence[Job], send: Callable[[Job], Awaitable[None]],
                    seed: int = 0) -> None:
    """Run `jobs` under `level`'s load pattern; returns when every job has been sent and finished."""
    if not jobs:
        return
    if level.mode == "concurrency":
        await _closed_loop(jobs, int(level.value), send)
    else:
        await _open_loop(jobs, level.value, send, seed)
