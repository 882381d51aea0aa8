"""Timed HTTP/1.1 for the speech request: every received segment carries the kernel's arrival time.

Why not aiohttp here: its transport reads with sock.recv(), so the earliest stamp it allows is the
moment the event loop gets round to the stream. With a hundred streams on two cores that moment
trails the arrival by the loop's backlog (10-30 ms measured), and the figures would describe the
client, not the server. Linux stamps every packet as it reaches the host (SO_TIMESTAMPNS, software
receive stamps) and recvmsg() hands the stamp over with the bytes, so a busy loop delays the reading,
never the times. One limit remains: TCP merges segments that wait unread in the receive queue and
keeps the newest stamp, so a stream's bytes keep their own arrival only while the loop reads each
stream before that stream's next write comes (tens of ms for speech chunks, not 2 ms). To keep the
loop that prompt, request starts and ends are paced (_run_paced) so that reading runs between them.

Stamps are CLOCK_REALTIME; they are moved onto perf_counter's clock (CLOCK_MONOTONIC) with one
offset sampled when the request starts. NTP slews both clocks alike, so that offset only changes when
the wall clock is stepped (settimeofday, a leap second): a step during a request shifts its arrivals.

Where the kernel gives no stamps (not Linux, the option refused, a segment without one) the segment
is stamped when the loop reads it, and `RawResponse.clock` says "loop" instead of "kernel".

The send time (`t_start`) is stamped right before the request's bytes go out, after any connection
setup. The timed path per segment is recvmsg, the HTTP framing (h11) and TLS record decryption, and an
append; decoding and statistics wait until the request has ended (ttsbench.decode, ttsbench.metrics).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import platform
import socket
import ssl
import struct
import sys
from dataclasses import dataclass, field
from time import perf_counter, perf_counter_ns, sleep, time_ns
from typing import Callable
from urllib.parse import urlsplit

import h11

_BUF = 1 << 16
_PACED_PER_ITERATION = 8
# SO_TIMESTAMPNS (35 in asm-generic; parisc and sparc number it differently, so they use loop stamps).
_SO_TIMESTAMPNS = (getattr(socket, "SO_TIMESTAMPNS", 35)
                   if sys.platform.startswith("linux") and not platform.machine().startswith(("parisc", "sparc"))
                   else None)
_ANC = socket.CMSG_SPACE(16) if _SO_TIMESTAMPNS is not None else 0
_TIMESPEC = {16: struct.Struct("@qq"), 8: struct.Struct("@ii")}


@dataclass
class RawResponse:
    """What came back, unparsed. Times are seconds on time.perf_counter (a monotonic clock).
    `chunks`: (arrival, body bytes) per received segment that carried body bytes."""
    t_start: float
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    t_headers: float | None = None
    chunks: list[tuple[float, bytes]] = field(default_factory=list)
    t_end: float | None = None
    error: str | None = None          # transport failure: connect, timeout, reset, other
    error_detail: str | None = None
    clock: str | None = None          # how arrivals were stamped: "kernel", "loop"; None if nothing arrived


class _Failure(Exception):
    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind, self.detail = kind, detail


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip().rstrip(":")


def _clock_offset_ns(tries: int = 3) -> int:
    """CLOCK_REALTIME minus perf_counter's clock, from reads taken together: of a few tries, the one with the
    narrowest window, since a preemption between the reads (seen: 0.5 ms on a loaded machine) would shift every
    stamp of the request by as much."""
    best_window, offset = None, 0
    for _ in range(tries):
        before = perf_counter_ns()
        real = time_ns()
        after = perf_counter_ns()
        if best_window is None or after - before < best_window:
            best_window, offset = after - before, real - (before + after) // 2
    return offset


def _stamp_ns(ancillary: list) -> int | None:
    """The SO_TIMESTAMPNS stamp (CLOCK_REALTIME ns) in a recvmsg's ancillary data, if any."""
    for level, kind, data in ancillary:
        unpack = _TIMESPEC.get(len(data))
        if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS and unpack is not None:
            sec, nsec = unpack.unpack(data)
            return sec * 1_000_000_000 + nsec
    return None


def _switch_on_kernel_stamps() -> socket.socket | None:
    """A socket that keeps the kernel's receive stamping on while it is open. Linux switches stamping
    on for the whole host when the first socket asks for it, in a deferred work item, and TCP segments
    that arrive before that carry no stamp. So ask before the first connection, and wait (about 0.2 s
    at most) until a datagram sent to the keeper itself is stamped while it is sent, not when read."""
    if _SO_TIMESTAMPNS is None:
        return None
    keeper = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        keeper.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
        keeper.bind(("127.0.0.1", 0))
        keeper.settimeout(0.2)
        for _ in range(200):
            before = time_ns()
            keeper.sendto(b"?", keeper.getsockname())
            after = time_ns()
            stamp = _stamp_ns(keeper.recvmsg(1, _ANC)[1])
            if stamp is not None and before <= stamp <= after:
                break
            sleep(0.001)
    except OSError:
        keeper.close()
        return None
    return keeper


class _Exchange:
    """One request's reading state; the connection's read callback fills `raw`. When the answer is
    complete (or failed), `finish` records the outcome and `hand_back` passes it on, paced."""
    __slots__ = ("raw", "offset_ns", "done", "hand_back", "outcome", "loop_stamped", "timer", "sending")

    def __init__(self, raw: RawResponse, done: asyncio.Future, hand_back: Callable[[_Exchange], None]):
        self.raw, self.done, self.hand_back = raw, done, hand_back
        self.offset_ns = _clock_offset_ns()
        self.outcome: _Failure | bool | None = None  # None while in flight, then True or the failure
        self.loop_stamped = False
        self.timer: asyncio.TimerHandle | None = None
        self.sending: asyncio.Task | None = None  # the rest of a request the socket did not take at once

    def finish(self, failure: _Failure | None = None) -> None:
        if self.outcome is None:
            self.outcome = failure or True
            self.hand_back(self)


class _Connection:
    """A socket with its HTTP/1.1 state (h11) and, for https, its TLS state (SSLObject over MemoryBIOs)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.sock: socket.socket | None = None
        self.http = h11.Connection(h11.CLIENT)
        self.tls: ssl.SSLObject | None = None
        self.incoming = self.outgoing = None
        self.kernel_stamps = False
        self.exchange: _Exchange | None = None

    async def connect(self, addrs: list, tls: ssl.SSLContext | None, host: str) -> None:
        last: OSError | None = None
        for family, type_, proto, _, addr in addrs:
            sock = socket.socket(family, type_, proto)
            try:
                sock.setblocking(False)
                if family in (socket.AF_INET, socket.AF_INET6):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await self.loop.sock_connect(sock, addr)
            except OSError as exc:
                sock.close()
                last = exc
                continue
            except BaseException:
                sock.close()
                raise
            self.sock = sock
            break
        else:
            raise _Failure("connect", _describe(last) if last else "the host has no address")
        if _SO_TIMESTAMPNS is not None:
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
                self.kernel_stamps = True
            except OSError:
                pass
        if tls is not None:
            try:
                await self._handshake(tls, host)
            except OSError as exc:
                raise _Failure("connect", f"TLS handshake: {_describe(exc)}") from None

    async def _handshake(self, context: ssl.SSLContext, host: str) -> None:
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_hostname=host)
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush_tls()
                data = await self.loop.sock_recv(self.sock, _BUF)
                if not data:
                    raise _Failure("connect", "the server closed the connection during the TLS handshake")
                self.incoming.write(data)
            except ssl.SSLError as exc:
                raise _Failure("connect", f"TLS handshake failed: {_describe(exc)}") from None
        await self._flush_tls()

    async def _flush_tls(self) -> None:
        pending = self.outgoing.read()
        if pending:
            await self.loop.sock_sendall(self.sock, pending)

    def reusable_when_idle(self) -> bool:
        """Whether an idle connection can carry a request: nothing arrived while idle (a FIN, a TLS
        close_notify, stray bytes) and h11 is ready for a new cycle."""
        if self.http.our_state is not h11.IDLE or self.http.their_state is not h11.IDLE:
            return False
        try:
            self.sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        return False

    def send_now(self, data: bytes) -> memoryview:
        """Write what the socket takes now (TLS: encrypted); returns what is left for later."""
        if self.tls is not None:
            self.tls.write(data)
            data = self.outgoing.read()
        try:
            sent = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        return memoryview(data)[sent:]

    def start_reading(self, exchange: _Exchange) -> None:
        self.exchange = exchange
        self.loop.add_reader(self.sock.fileno(), self._on_readable)

    def stop_reading(self) -> None:
        self.exchange = None
        self.loop.remove_reader(self.sock.fileno())

    def _on_readable(self) -> None:
        ex = self.exchange
        if ex.outcome is not None:  # answered, failed or timed out: the request's coroutine takes over
            self.loop.remove_reader(self.sock.fileno())
            return
        try:
            if _ANC:
                data, anc, _, _ = self.sock.recvmsg(_BUF, _ANC)
            else:
                data, anc = self.sock.recv(_BUF), None
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            ex.finish(_Failure("reset", _describe(exc)))
            return
        stamp = _stamp_ns(anc) if anc else None
        if stamp is not None:
            t = (stamp - ex.offset_ns) / 1e9
        else:  # no stamp: loop time (an end of stream never carries one, and needs none)
            t = perf_counter()
            ex.loop_stamped = ex.loop_stamped or bool(data)
        try:
            eof = not data
            if self.tls is not None:
                data, eof = self._decrypt(data)
            if data:
                self.http.receive_data(data)
            if eof:
                self.http.receive_data(b"")
            self._events(t, ex, eof)
        except _Failure as f:
            ex.finish(f)
        except Exception as exc:  # a harness bug must fail this request, not stall it until its timeout
            ex.finish(_Failure("other", f"harness: {_describe(exc)}"))

    def _decrypt(self, data: bytes) -> tuple[bytes, bool]:
        """The plaintext of the TLS records these bytes completed, and whether the stream ended."""
        eof = not data
        if eof:
            self.incoming.write_eof()
        else:
            self.incoming.write(data)
        plain = []
        try:
            while True:
                piece = self.tls.read(_BUF)
                if not piece:
                    eof = True
                    break
                plain.append(piece)
        except ssl.SSLWantReadError:
            pass
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError):  # close_notify, or the TCP stream ended
            eof = True
        except ssl.SSLError as exc:
            raise _Failure("reset", f"TLS: {_describe(exc)}") from None
        if self.outgoing.pending:  # TLS may have something to answer (a key update)
            try:
                self.sock.send(self.outgoing.read())
            except OSError:
                pass
        return b"".join(plain), eof

    def _events(self, t: float, ex: _Exchange, eof: bool) -> None:
        raw, http = ex.raw, self.http
        while True:
            try:
                event = http.next_event()
            except h11.RemoteProtocolError as exc:
                if not eof:
                    raise _Failure("other", f"malformed HTTP response: {exc}") from None
                if raw.status is None:
                    raise _Failure("reset", "the server closed the connection before answering") from None
                raise _Failure("reset", f"connection closed before the response was complete ({exc})") from None
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            kind = type(event)
            if kind is h11.Data:
                raw.chunks.append((t, bytes(event.data)))
            elif kind is h11.Response:
                raw.t_headers, raw.status = t, event.status_code
                raw.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in event.headers}
            elif kind is h11.EndOfMessage:
                raw.t_end = t
                ex.finish()
                return
            elif kind is h11.ConnectionClosed:
                raise _Failure("reset", "the server closed the connection")

    def close(self) -> None:
        if self.sock is not None:
            if self.exchange is not None:
                self.stop_reading()
            self.sock.close()
            self.sock = None


class TimedHTTP:
    """POSTs to one URL over a pool of keep-alive connections (grown to the load, no cap) and returns
    each answer as a RawResponse with kernel-stamped arrivals. Never raises for a failed request."""

    def __init__(self, url: str, headers: dict[str, str], timeout: float,
                 ssl_context: ssl.SSLContext | None = None):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.tls = (ssl_context or ssl.create_default_context()) if parts.scheme == "https" else None
        default_port = self.port == (443 if self.tls else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.headers = [("Host", host if default_port else f"{host}:{self.port}"), *headers.items()]
        self.timeout = timeout
        self._addrs: asyncio.Future | None = None
        self._idle: list[_Connection] = []
        self._stamps_on = _switch_on_kernel_stamps()
        self._paced: collections.deque[Callable[[], None]] = collections.deque()
        self.requests_by_clock: dict[str, int] = {}

    async def _addresses(self, loop: asyncio.AbstractEventLoop) -> list:
        """The server's addresses, resolved once for all the connections that start together."""
        if self._addrs is None or (self._addrs.done() and self._addrs.exception() is not None):
            self._addrs = asyncio.ensure_future(loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM))
        try:
            return await asyncio.shield(self._addrs)
        except socket.gaierror as exc:
            raise _Failure("connect", f"cannot resolve {self.host}: {_describe(exc)}") from None

    def _take_idle(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()  # the most recently used: the least likely to be closed by the server
            if conn.reusable_when_idle():
                return conn
            conn.close()
        return None

    async def post(self, body: bytes) -> RawResponse:
        loop = asyncio.get_running_loop()
        raw = RawResponse(t_start=perf_counter())  # replaced by the send time once the request goes out
        deadline = loop.time() + self.timeout
        conn = self._take_idle()
        exchange: _Exchange | None = None
        failure: _Failure | None = None
        try:
            if conn is None:
                conn = _Connection(loop)
                await asyncio.wait_for(conn.connect(await self._addresses(loop), self.tls, self.host),
                                       self.timeout)
            http = conn.http
            request = (http.send(h11.Request(method="POST", target=self.target,
                                             headers=[*self.headers, ("Content-Length", str(len(body)))]))
                       + http.send(h11.Data(data=body)) + http.send(h11.EndOfMessage()))
            exchange = _Exchange(raw, loop.create_future(), self._hand_back)
            exchange.timer = loop.call_at(deadline, exchange.finish,
                                          _Failure("timeout", f"no complete response within {self.timeout:g} s"))
            self._pace(functools.partial(self._send, conn, exchange, request))
            failure = await exchange.done
        except asyncio.TimeoutError:
            failure = _Failure("timeout", f"no complete response within {self.timeout:g} s")
        except _Failure as f:
            failure = f
        except asyncio.CancelledError:
            if conn is not None:
                conn.close()
            raise
        except Exception as exc:  # every failure is a result to record, never a crash
            failure = _Failure("other", _describe(exc))
        finally:
            if exchange is not None:
                exchange.timer.cancel()
                if exchange.sending is not None:
                    exchange.sending.cancel()
        if failure is not None:
            raw.t_end = perf_counter()
            raw.error, raw.error_detail = failure.kind, failure.detail
            if conn is not None:
                conn.close()
        else:
            conn.stop_reading()
            if conn.http.our_state is h11.DONE and conn.http.their_state is h11.DONE:
                conn.http.start_next_cycle()
                self._idle.append(conn)
            else:
                conn.close()
        if raw.t_headers is not None:
            raw.clock = "loop" if exchange.loop_stamped or not conn.kernel_stamps else "kernel"
            self.requests_by_clock[raw.clock] = self.requests_by_clock.get(raw.clock, 0) + 1
        return raw

    def _pace(self, step: Callable[[], None]) -> None:
        self._paced.append(step)
        if len(self._paced) == 1:
            asyncio.get_running_loop().call_soon(self._run_paced)

    def _run_paced(self) -> None:
        """Start or end at most _PACED_PER_ITERATION requests per loop iteration, then let the loop read.
        When many streams end together, their ends and the starts of their successors (the caller's
        bookkeeping, a new request on the wire, which on loopback also wakes the server) would all run in
        one iteration and hold every other stream's reading for tens of ms: long enough for a stream's
        next chunk to merge with the unread one in the socket, under one arrival stamp."""
        paced = self._paced
        for _ in range(min(_PACED_PER_ITERATION, len(paced))):
            paced.popleft()()
        if paced:
            asyncio.get_running_loop().call_soon(self._run_paced)

    def _hand_back(self, exchange: _Exchange) -> None:
        self._pace(functools.partial(self._wake, exchange))

    @staticmethod
    def _wake(exchange: _Exchange) -> None:
        if not exchange.done.done():  # not cancelled
            exchange.done.set_result(None if exchange.outcome is True else exchange.outcome)

    def _send(self, conn: _Connection, exchange: _Exchange, request: bytes) -> None:
        if exchange.outcome is not None or exchange.done.done():  # timed out or cancelled while queued
            return
        conn.start_reading(exchange)
        exchange.raw.t_start = perf_counter()  # right before the request's bytes go out
        try:
            rest = conn.send_now(request)
        except Exception as exc:  # OSError (ssl.SSLError too); anything else must not stop the pacing
            exchange.finish(_Failure("reset" if isinstance(exc, OSError) else "other", _describe(exc)))
            return
        if rest:
            exchange.sending = asyncio.get_running_loop().create_task(self._send_rest(conn, exchange, rest))

    @staticmethod
    async def _send_rest(conn: _Connection, exchange: _Exchange, rest: memoryview) -> None:
        try:
            await conn.loop.sock_sendall(conn.sock, rest)
        except OSError as exc:
            exchange.finish(_Failure("reset", _describe(exc)))

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
        if self._stamps_on is not None:
            self._stamps_on.close()
            self._stamps_on = None
