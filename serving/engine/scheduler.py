"""Continuous batching bookkeeping: the waiting queue, KV slots, and the batch-size bucket of each step.

Pure Python, no tensors: the talker stage asks it who runs next. Slots are rows of the preallocated KV
cache. A new request takes the lowest free slot, so the running rows stay packed at the front and a
decode step over the first `bucket` rows (a fixed-shape view of the cache, one CUDA graph per bucket)
covers every running request. Requests end in any order, though: as a wave drains, its last rows can sit
high in the cache, and every step would compute the empty rows below them. `compact` moves them down.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class QueueFullError(Exception):
    """Every slot is taken and the waiting queue is at its limit: the server answers 503."""


def make_buckets(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then steps of 8 up to max_batch_size (always included): few graphs, little padding."""
    if max_batch_size < 1:
        raise ValueError("max_batch_size must be at least 1")
    sizes = [b for b in (1, 2, 4) if b < max_batch_size]
    sizes += list(range(8, max_batch_size, 8))
    sizes.append(max_batch_size)
    return tuple(sorted(set(sizes)))


def pick_bucket(rows: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket that holds `rows` rows."""
    for b in buckets:
        if b >= rows:
            return b
    raise ValueError(f"{rows} rows exceed the largest bucket {buckets[-1]}")


class Scheduler(Generic[T]):
    def __init__(self, num_slots: int, max_queue: int, buckets: tuple[int, ...] | None = None,
                 ready: Callable[[T], bool] = lambda item: True):
        """`ready`: whether a waiting request may take a slot yet (a voice clone's reference may still be being
        encoded); requests that are not wait in their place while later ready ones go ahead."""
        if num_slots < 1:
            raise ValueError("the KV cache must hold at least one request")
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        self.num_slots = num_slots
        self.max_queue = max_queue
        self.buckets = buckets or make_buckets(num_slots)
        if self.buckets[-1] < num_slots:
            raise ValueError("the largest bucket must cover every slot")
        self.ready = ready
        self.waiting: deque[T] = deque()
        self.slots: list[T | None] = [None] * num_slots

    # --- queue ---------------------------------------------------------------------------------------------
    def submit(self, item: T) -> None:
        """Queue a request; it runs as soon as a slot frees. Raises QueueFullError past the queue limit."""
        # Requests waiting for a slot that is already free are admitted at the next step: not queued.
        if len(self.waiting) >= self.max_queue + self.num_free:
            raise QueueFullError(f"all {self.num_slots} slots are busy and {len(self.waiting)} requests wait")
        self.waiting.append(item)

    def remove_waiting(self, item: T) -> bool:
        try:
            self.waiting.remove(item)
            return True
        except ValueError:
            return False

    def admit(self, limit: int | None = None) -> list[tuple[int, T]]:
        """Move ready waiting requests into free slots (lowest first) in their order of arrival, at most `limit` of
        them: (slot, item) pairs."""
        most = self.num_free if limit is None else min(limit, self.num_free)
        admitted, kept = [], []
        while self.waiting and len(admitted) < most:
            item = self.waiting.popleft()
            if not self.ready(item):
                kept.append(item)
                continue
            slot = self.slots.index(None)
            self.slots[slot] = item
            admitted.append((slot, item))
        self.waiting.extendleft(reversed(kept))  # back in front, in their order
        return admitted

    @property
    def num_ready(self) -> int:
        """Waiting requests that could take a slot now."""
        return sum(map(self.ready, self.waiting))

    # --- slots ---------------------------------------------------------------------------------------------
    def release(self, slot: int) -> None:
        if self.slots[slot] is None:
            raise ValueError(f"slot {slot} is already free")
        self.slots[slot] = None

    def running(self) -> list[tuple[int, T]]:
        return [(i, item) for i, item in enumerate(self.slots) if item is not None]

    @property
    def num_running(self) -> int:
        return sum(item is not None for item in self.slots)

    @property
    def num_free(self) -> int:
        return self.num_slots - self.num_running

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def compact(self) -> list[tuple[int, int]]:
        """Move the requests above the bucket the running ones need into the lowest free slots: (from, to) pairs,
        for the talker stage to move their state; none while the rows fit that bucket, so steady load moves
        nothing. A draining wave's tail then steps over its few rows instead of the wave's width (H100, 0.6B: a
        frame of 1 row 2.8 ms, of 32 rows 4.5 ms, docs/performance.md)."""
        need = pick_bucket(self.num_running, self.buckets) if self.num_running else 0
        free = [i for i in range(need) if self.slots[i] is None]
        moves = [(src, free.pop(0)) for src in range(need, self.num_slots) if self.slots[src] is not None]
        for src, dst in moves:
            self.slots[dst], self.slots[src] = self.slots[src], None
        return moves

    def bucket(self) -> int:
        """Rows the next decode step covers: up to the highest occupied slot, rounded up to a bucket."""
        highest = max((i for i, item in enumerate(self.slots) if item is not None), default=-1)
        return pick_bucket(highest + 1, self.buckets) if highest >= 0 else 0
