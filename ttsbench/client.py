"""The HTTP client: one shared aiohttp session; the timed section only stamps and stores chunks.

Everything that costs CPU (decoding SSE/WAV, statistics, saving audio) happens after a request
completes (see ttsbench.decode and ttsbench.metrics), so a busy client does not delay the arrival
stamps of the other streams it is reading.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from time import perf_counter

import aiohttp
import yarl

from ttsbench import datasets

_JSON = {"Content-Type": "application/json"}


@dataclass
class RawResponse:
    """What came back, unparsed. Times are seconds on time.perf_counter (a monotonic clock)."""
    t_start: float
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    t_headers: float | None = None
    chunks: list[tuple[float, bytes]] = field(default_factory=list)
    t_end: float | None = None
    error: str | None = None          # transport failure: connect, timeout, reset, other
    error_detail: str | None = None


def _transport_error(exc: BaseException, timeout: float) -> tuple[str, str]:
    detail = f"{type(exc).__name__}: {exc}".strip().rstrip(":")
    if isinstance(exc, asyncio.TimeoutError):
        return "timeout", f"no complete response within {timeout:g} s"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect", detail
    if isinstance(exc, (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
                        aiohttp.ClientOSError, ConnectionError)):
        return "reset", detail
    return "other", detail


class SpeechClient:
    """A session against one server. Use as `async with SpeechClient(url) as client:`."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 300.0):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "SpeechClient":
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        # limit=0: no cap on connections, so the load generator alone decides concurrency.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=3600)
        # No cookie jar, a pre-parsed URL and a fixed timeout object: less work per request start,
        # which at high concurrency is time the event loop is not reading other streams.
        self._session = aiohttp.ClientSession(
            connector=connector, headers=headers, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
            timeout=aiohttp.ClientTimeout(total=None), read_bufsize=1 << 18)
        self._speech_url = yarl.URL(self.base_url + "/v1/audio/speech")
        self._speech_timeout = aiohttp.ClientTimeout(total=self.timeout)
        return self

    async def __aexit__(self, *exc) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("SpeechClient used outside 'async with'")
        return self._session

    async def speech(self, body: bytes) -> RawResponse:
        """POST /v1/audio/speech and read the whole response, stamping each chunk's arrival.
        Never raises for a failed request: the failure is in the returned RawResponse."""
        url, timeout = self._speech_url, self._speech_timeout
        raw = RawResponse(t_start=perf_counter())
        chunks = raw.chunks
        append = chunks.append
        clock = perf_counter
        try:
            async with self.session.post(url, data=body, headers=_JSON, timeout=timeout) as resp:
                raw.t_headers = clock()
                raw.status = resp.status
                raw.headers = {k.lower(): v for k, v in resp.headers.items()}
                async for data in resp.content.iter_any():
                    append((clock(), data))
                raw.t_end = clock()  # before releasing the connection, which is not part of the answer
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # every failure is a result to record, never a crash
            raw.t_end = clock()
            raw.error, raw.error_detail = _transport_error(exc, self.timeout)
        return raw

    async def get_json(self, path: str) -> dict | None:
        """A server's self-description (/v1/models, /health), or None if it does not answer."""
        try:
            async with self.session.get(self.base_url + path,
                                        timeout=aiohttp.ClientTimeout(total=10)) as resp:
                text = await resp.text()
                try:
                    content = json.loads(text)
                except json.JSONDecodeError:
                    content = text[:2000]
                return {"status": resp.status, "body": content}
        except Exception as exc:
            return {"status": None, "error": f"{type(exc).__name__}: {exc}"}

    async def upload_voice(self, voice: datasets.Voice) -> None:
        """Register a reference clip under its name (POST /v1/audio/voices), replacing an older one."""
        name_url = f"{self.base_url}/v1/audio/voices/{voice.name}"
        async with self.session.delete(name_url, timeout=aiohttp.ClientTimeout(total=30)):
            pass  # 404 when absent: fine
        form = aiohttp.FormData()
        form.add_field("name", voice.name)
        form.add_field("consent", "true")
        form.add_field("ref_text", voice.ref_text)
        form.add_field("audio_sample", voice.path.read_bytes(), filename=voice.path.name,
                       content_type="audio/wav")
        async with self.session.post(self.base_url + "/v1/audio/voices", data=form,
                                     timeout=aiohttp.ClientTimeout(total=60)) as resp:
            if resp.status >= 400:
                text = (await resp.text())[:500]
                raise RuntimeError(f"uploading voice {voice.name!r} failed: HTTP {resp.status}: {text}")
