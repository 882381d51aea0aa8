"""The client of one server: the timed speech request on its own transport, the rest on aiohttp.

The speech request goes through ttsbench.transport, which stamps every received segment with the
kernel's arrival time (recvmsg with SO_TIMESTAMPNS). aiohttp reads with sock.recv() and can only stamp
a chunk when the event loop resumes the reader, late by the loop's backlog at high concurrency; its
transport exposes no ancillary data, so the timed path cannot be built on it. The calls that are not
timed (/health, /v1/models, voice upload) stay on one aiohttp session: each tool does one job.

Everything that costs CPU (decoding SSE/WAV, statistics, saving audio) happens after a request
completes (see ttsbench.decode and ttsbench.metrics, run in the recorder process).
"""

from __future__ import annotations

import json
import ssl

import aiohttp

import ttsbench
from ttsbench import datasets
from ttsbench.transport import RawResponse, TimedHTTP

__all__ = ["RawResponse", "SpeechClient", "combine_clocks"]


def combine_clocks(clocks) -> str | None:
    """One name for the clocks that stamped a set of arrivals: "kernel" or "loop" when all agree,
    "mixed" when they differ, None when nothing was stamped."""
    seen = {c for c in clocks if c is not None}
    return seen.pop() if len(seen) == 1 else ("mixed" if seen else None)


class SpeechClient:
    """A session against one server. Use as `async with SpeechClient(url) as client:`.
    `ssl_context` replaces the system's trust store for https (e.g. a private CA)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 300.0,
                 ssl_context: ssl.SSLContext | None = None):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.ssl_context = ssl_context
        self._session: aiohttp.ClientSession | None = None
        self._speech: TimedHTTP | None = None

    async def __aenter__(self) -> "SpeechClient":
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._speech = TimedHTTP(self.base_url + "/v1/audio/speech",  # first: it checks the URL
                                 {"Content-Type": "application/json", "Accept": "*/*",
                                  "User-Agent": f"ttsbench/{ttsbench.__version__}", **auth},
                                 self.timeout, self.ssl_context)
        self._session = aiohttp.ClientSession(
            headers=auth, connector=aiohttp.TCPConnector(ssl=self.ssl_context or True))
        return self

    async def __aexit__(self, *exc) -> None:
        if self._speech is not None:
            self._speech.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("SpeechClient used outside 'async with'")
        return self._session

    @property
    def arrival_clock(self) -> str | None:
        """How this session's arrivals were stamped: "kernel", "loop", "mixed", or None before any answer."""
        return combine_clocks(self._speech.requests_by_clock if self._speech is not None else ())

    async def speech(self, body: bytes) -> RawResponse:
        """POST /v1/audio/speech and read the whole response, stamping each segment's arrival.
        Never raises for a failed request: the failure is in the returned RawResponse."""
        if self._speech is None:
            raise RuntimeError("SpeechClient used outside 'async with'")
        return await self._speech.post(body)

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
