"""Mailbox: calls handed to a loop from other threads run there in order, with one wake-up per batch."""

import asyncio
import threading

import pytest

from serving.engine.mailbox import Mailbox
from tests.server_fixtures import wait_until


def _loop_in_thread():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    return loop, thread


def _stop(loop, thread):
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def test_calls_posted_while_the_loop_is_busy_run_in_order_after_one_wake():
    loop, thread = _loop_in_thread()
    try:
        busy, ran, done = threading.Event(), [], threading.Event()
        loop.call_soon_threadsafe(busy.wait, 10)  # the loop is held, as a busy handler holds the server's loop
        box = Mailbox.of(loop)
        for i in range(100):
            box.post(ran.append, i)
        box.post(done.set)
        busy.set()
        assert done.wait(10)
        assert ran == list(range(100)) and box.wakes == 1
        box.post(done.clear)  # drained: the next call wakes the loop again
        assert wait_until(lambda: not done.is_set()) and box.wakes == 2
    finally:
        _stop(loop, thread)


def test_one_mailbox_a_loop():
    loop, other = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        assert Mailbox.of(loop) is Mailbox.of(loop)
        assert Mailbox.of(loop) is not Mailbox.of(other)
    finally:
        loop.close()
        other.close()


def test_a_call_that_raises_does_not_drop_the_calls_after_it(caplog):
    loop, thread = _loop_in_thread()
    try:
        box, ran, done = Mailbox.of(loop), [], threading.Event()
        busy = threading.Event()
        loop.call_soon_threadsafe(busy.wait, 10)
        box.post(ran.append, 1)
        box.post(lambda: 1 / 0)
        box.post(ran.append, 2)
        box.post(done.set)
        busy.set()
        assert done.wait(10) and ran == [1, 2]
        assert "ZeroDivisionError" in caplog.text
    finally:
        _stop(loop, thread)


def test_posting_to_a_closed_loop_says_so_every_time():
    loop, thread = _loop_in_thread()
    _stop(loop, thread)
    box = Mailbox.of(loop)
    for _ in range(2):
        with pytest.raises(RuntimeError):
            box.post(print, "never")


def test_calls_from_several_threads_all_run_once():
    loop, thread = _loop_in_thread()
    try:
        box, ran = Mailbox.of(loop), []
        posters = [threading.Thread(target=lambda k=k: [box.post(ran.append, (k, i)) for i in range(500)])
                   for k in range(4)]
        for t in posters:
            t.start()
        for t in posters:
            t.join(10)
        assert wait_until(lambda: len(ran) == 2000)
        assert sorted(ran) == [(k, i) for k in range(4) for i in range(500)]
        for k in range(4):  # each thread's calls in the order it posted them
            assert [i for kk, i in ran if kk == k] == list(range(500))
    finally:
        _stop(loop, thread)



def test_a_loop_that_is_gone_leaves_no_mailbox_behind():
    import gc
    import weakref

    loop = asyncio.new_event_loop()
    box = Mailbox.of(loop)
    gone = weakref.ref(loop)
    loop.close()
    del loop
    gc.collect()
    assert gone() is None  # the registry did not keep it
    with pytest.raises(RuntimeError):
        box.post(print, "never")
