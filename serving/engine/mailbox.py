"""Calls handed to an event loop from other threads, with one wake-up of the loop per batch of them.

`loop.call_soon_threadsafe` writes a byte to the loop's self-pipe on every call: a system call that lets go of
the interpreter, which the calling thread then waits to take back beside the engine's busy stage threads. The
engine handed the server's loop every chunk of audio it decoded that way (a codec call of 32 rows: 32 writes),
and every request crossed over with two more (its submission and its acceptance); in a py-spy profile of a burst
of 64 clones on the development VM the write was a third of the handlers' samples. A mailbox wakes its loop only
when nothing it holds is pending already, so a burst costs one wake instead of one a call, and calls still run in
the order they were posted (a tiny server, 64 custom-voice requests of 25 frames at 32 streams: the engine's
thread wrote 485 times, now 61; docs/performance.md).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections import deque
from typing import Callable

log = logging.getLogger("serving.engine")

_MAILBOXES: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox]" = weakref.WeakKeyDictionary()
_MAILBOXES_LOCK = threading.Lock()


class Mailbox:
    """Posted calls run on `loop`, in order, each at most once; a call that raises is logged and the rest run."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)  # not the loop itself: the registry's entry would keep its key alive
        self._calls: deque[tuple[Callable, tuple]] = deque()
        self._lock = threading.Lock()
        self._waking = False  # a drain is scheduled and has not yet taken the calls
        self.wakes = 0  # the loop's wake-ups so far (its self-pipe writes): what the mailbox saves is visible

    @staticmethod
    def of(loop: asyncio.AbstractEventLoop) -> "Mailbox":
        """The one mailbox of a loop: every thread that posts to it shares its wake-ups."""
        with _MAILBOXES_LOCK:
            box = _MAILBOXES.get(loop)
            if box is None:
                box = _MAILBOXES[loop] = Mailbox(loop)
            return box

    def post(self, fn: Callable, *args) -> None:
        """Run fn(*args) on the loop soon. Raises RuntimeError when the loop is closed and had to be woken."""
        with self._lock:
            self._calls.append((fn, args))
            if self._waking:
                return
            self._waking = True
            self.wakes += 1
        try:
            loop = self._loop()
            if loop is None:
                raise RuntimeError("the event loop is gone")
            loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # closed: nothing will drain; let the next post try (and raise) again
            with self._lock:
                self._waking = False
                self._calls.clear()
            raise

    def _drain(self) -> None:
        with self._lock:
            self._waking = False
            calls, self._calls = self._calls, deque()
        for fn, args in calls:
            try:
                fn(*args)
            except Exception:
                log.exception("a call handed to the loop failed: %r", fn)
