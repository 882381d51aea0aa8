"""A real reference server on a loopback socket, running in a background thread, for the server tests."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from pathlib import Path

from aiohttp import web

from serving.api.main import ServeOptions, build_server

# Small enough for a shared 2-core CI machine: few frames per chunk, short context, short slots.
FAST = dict(max_model_len=256, chunk_frames=5, first_chunk_frames=2, left_context_frames=8)


class ServerThread:
    def __init__(self, model: str, voices_dir: Path, **options):
        opts = {**FAST, **options}
        self.server = build_server(ServeOptions(model=model, voices_dir=voices_dir, port=0, **opts))
        self.loop = asyncio.new_event_loop()
        self.port: int | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._started.wait(60)
        self.url = f"http://127.0.0.1:{self.port}"
        self._wait_healthy()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.runner = web.AppRunner(self.server.make_app(), handler_cancellation=True, access_log=None)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._started.set()
        self.loop.run_forever()

    def _wait_healthy(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except Exception:
                pass
            if self.server._startup_error:
                raise RuntimeError(self.server._startup_error)
            time.sleep(0.2)
        raise TimeoutError("server did not become healthy")

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def stop(self) -> None:
        fut = asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop)
        fut.result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)


def post_json(url: str, body: dict, headers: dict | None = None, timeout: float = 120) -> tuple[int, dict, bytes]:
    """(status, headers, body) of a POST; error statuses are returned, not raised."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def logged(server: ServerThread, request_id: str, timeout: float = 10.0) -> dict:
    """The --request-log line of `request_id` (the X-Request-Id header). It is written as the handler ends, after
    the client's read, so it may come a moment later; matched by id, since earlier requests' lines are there too."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [json.loads(x) for x in server.server.request_log.path.read_text().splitlines()]
        found = [r for r in lines if r["request_id"] == request_id]
        if found or time.monotonic() > deadline:
            assert found, lines[-3:]
            return found[-1]
        time.sleep(0.05)


def wait_until(condition, seconds=10.0) -> bool:
    """Whether condition() came true within `seconds` (polled)."""
    for _ in range(int(seconds / 0.05)):
        if condition():
            return True
        time.sleep(0.05)
    return condition()
