"""Continuous batching bookkeeping: buckets, packing into the lowest slots, queue limits."""

import pytest

from serving.engine.scheduler import QueueFullError, Scheduler, make_buckets, pick_bucket


def test_buckets():
    assert make_buckets(1) == (1,)
    assert make_buckets(8) == (1, 2, 4, 8)
    assert make_buckets(32) == (1, 2, 4, 8, 16, 24, 32)
    assert make_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert pick_bucket(3, (1, 2, 4, 8)) == 4 and pick_bucket(8, (1, 2, 4, 8)) == 8
    with pytest.raises(ValueError):
        pick_bucket(9, (1, 2, 4, 8))


def test_admission_fills_lowest_slots_and_queue_limit_applies_past_free_slots():
    s = Scheduler(num_slots=4, max_queue=2)
    for i in range(6):
        s.submit(f"r{i}")
    with pytest.raises(QueueFullError):
        s.submit("r6")
    assert s.admit(limit=3) == [(0, "r0"), (1, "r1"), (2, "r2")]
    assert s.bucket() == 4 and s.num_waiting == 3
    assert s.admit() == [(3, "r3")]
    s.release(1)
    assert s.bucket() == 4 and s.num_free == 1
    assert s.admit() == [(1, "r4")]
    s.submit("r6")
    with pytest.raises(QueueFullError):
        s.submit("r7")


def test_bucket_shrinks_as_high_slots_free():
    s = Scheduler(num_slots=8, max_queue=0)
    for i in range(5):
        s.submit(i)
    s.admit()
    assert s.bucket() == 8
    s.release(4)
    assert s.bucket() == 4
    for slot in range(4):
        s.release(slot)
    assert s.bucket() == 0 and s.running() == []
    with pytest.raises(ValueError):
        s.release(0)


def test_compaction_moves_the_rows_above_the_needed_bucket_into_the_lowest_free_slots():
    """A draining wave leaves its last rows high in the cache; they move down as far as the bucket the running
    rows need, highest-numbered into lowest free first, and rows that already fit that bucket never move."""
    s = Scheduler(num_slots=32, max_queue=0)
    for i in range(32):
        s.submit(f"r{i}")
    s.admit()
    for slot in range(1, 30):
        if slot not in (5, 17):
            s.release(slot)
    assert s.bucket() == 32 and s.num_running == 5  # r0, r5, r17, r30, r31
    assert s.compact() == [(17, 1), (30, 2), (31, 3)]
    assert s.running() == [(0, "r0"), (1, "r17"), (2, "r30"), (3, "r31"), (5, "r5")]
    assert s.bucket() == 8 and s.compact() == []  # 5 rows need the bucket of 8: r5 stays
    for slot in (0, 1, 2, 5):
        s.release(slot)
    assert s.compact() == [(3, 0)] and s.running() == [(0, "r31")] and s.bucket() == 1
    s.release(0)
    assert s.compact() == [] and s.bucket() == 0


def test_steady_load_moves_nothing():
    """Rows freed and refilled at the front never trigger a move while the running rows need the same bucket."""
    s = Scheduler(num_slots=8, max_queue=8)
    for i in range(8):
        s.submit(i)
    s.admit()
    s.release(2), s.release(6)
    assert s.compact() == []  # 6 rows still need 8
    s.submit(8)
    assert s.admit() == [(2, 8)] and s.compact() == []


def test_cancelled_waiting_requests_leave_the_queue():
    s = Scheduler(num_slots=1, max_queue=1)
    s.submit("a")
    s.admit()
    s.submit("b")
    assert s.remove_waiting("b") and not s.remove_waiting("b")
    s.submit("c")
    assert s.num_waiting == 1


def test_requests_not_ready_keep_their_place_while_later_ones_go_ahead():
    """A voice clone whose reference is still being encoded waits; ready requests behind it take the free slots,
    in their order, and it is admitted first once ready. Waiting requests still count against the queue limit."""
    pending = {"b", "d"}
    s = Scheduler(num_slots=2, max_queue=3, ready=lambda item: item not in pending)
    for item in "abcde":
        s.submit(item)
    with pytest.raises(QueueFullError):
        s.submit("f")
    assert s.num_ready == 3
    assert s.admit() == [(0, "a"), (1, "c")]
    assert list(s.waiting) == ["b", "d", "e"] and s.num_ready == 1
    s.release(0)
    assert s.admit() == [(0, "e")] and list(s.waiting) == ["b", "d"] and s.num_ready == 0
    s.release(1)
    assert s.admit() == [] and list(s.waiting) == ["b", "d"]
    pending.clear()
    assert s.admit() == [(1, "b")] and list(s.waiting) == ["d"]
