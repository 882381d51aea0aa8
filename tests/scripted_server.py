"""A real speech server on a loopback socket that answers on a scripted schedule, for harness tests.

Run it as its own process (so its event loop and GIL are not the client's):

    python -m tests.scripted_server --script SCRIPT.json --log LOG.jsonl [--tls-cert C --tls-key K]

It prints `PORT <n>` once listening (https with --tls-cert). SCRIPT maps each request's `input` text
to a scenario:

    {"form": "pcm" | "wav" | "sse" | "flac" | "json",   # what the answer looks like (default pcm)
     "status": 200,                      # an error status answers an OpenAI-style JSON error
     "chunks": [[t_ms, n_bytes], ...],   # audio writes, at t_ms after the request arrived
     "after": "eof" | "reset" | "hang",  # how the body ends after the last chunk
     "framing": "chunked" | "length",    # chunked transfer coding, or a Content-Length body (one
                                         # that ends early announces a chunk more than it sends)
     "rate": 24000, "sse_done": true, "wav_data_size": null}

Texts not in the script get `{"chunks": [[0, 4800]]}`. For every request, LOG receives one line:
the text, headers and body fields (ref_audio shortened), the client's port (`peer_port`, to see
connection reuse), and the server's own perf_counter stamps (the same monotonic clock as the client's
on Linux): t_recv; writes [[t, n_audio_bytes, t_sent], ...]; t_eof and t_eof_sent for the end of the
body. These stamps are the truth the harness is checked against: `t` is taken right before the write
and `t_sent` right after it, with nothing between them but aiohttp's synchronous write path and the
socket send, so the bytes left in [t, t_sent] (almost always some 50 us wide; wider when the
operating system preempted the server in between, which is no error of the client's).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import ssl
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter

import numpy as np
import soundfile
from aiohttp import web


def _pcm(n_bytes: int, seed: int) -> bytes:
    return (np.arange(n_bytes // 2, dtype=np.int16) * 7 + seed).astype("<i2").tobytes() + b"\x01" * (n_bytes % 2)


def _wav_header(rate: int, data_size: int) -> bytes:
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    riff_size = 0xFFFFFFFF if data_size == 0xFFFFFFFF else 36 + data_size
    return b"RIFF" + struct.pack("<I", riff_size) + b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + \
        b"data" + struct.pack("<I", data_size)


class ScriptedServer:
    def __init__(self, script: dict, log_path: str):
        self.script = script
        self.log = open(log_path, "a", encoding="utf-8")
        self.voices: dict[str, dict] = {}

    async def _sleep_until(self, t: float) -> None:
        delay = t - perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)

    def _write_log(self, entry: dict) -> None:
        self.log.write(json.dumps(entry) + "\n")
        self.log.flush()

    async def speech(self, request: web.Request) -> web.StreamResponse:
        t_recv = perf_counter()
        body = await request.json()
        fields = {k: (v[:40] if k == "ref_audio" and isinstance(v, str) else v) for k, v in body.items()}
        peer = request.transport.get_extra_info("peername") if request.transport else None
        entry = {"text": body.get("input"), "t_recv": t_recv, "writes": [], "t_eof": None, "t_eof_sent": None,
                 "fields": fields, "authorization": request.headers.get("Authorization"),
                 "peer_port": peer[1] if peer else None}
        sc = self.script.get(body.get("input"), {"chunks": [[0, 4800]]})
        try:
            return await self._answer(request, sc, t_recv, entry)
        except ConnectionResetError:  # the client went away (timeout, Ctrl-C): nothing to answer
            entry["client_gone"] = True
            return web.Response()
        finally:
            self._write_log(entry)

    async def _answer(self, request: web.Request, sc: dict, t_recv: float, entry: dict) -> web.StreamResponse:
        status, form, rate = sc.get("status", 200), sc.get("form", "pcm"), sc.get("rate", 24000)
        chunks = sc.get("chunks", [])
        if status >= 400:
            if chunks:
                await self._sleep_until(t_recv + chunks[0][0] / 1000)
            return web.json_response({"error": {"message": f"scripted failure {status}", "type": "server_error",
                                                "param": None, "code": status}}, status=status)
        if form == "json":
            return web.json_response({"note": "not audio"})
        if form == "flac":  # one write of the whole file, at the first chunk's time
            total = sum(n for _, n in chunks)
            samples = np.frombuffer(_pcm(total, 0), dtype="<i2")
            buf = io.BytesIO()
            soundfile.write(buf, samples, rate, format="FLAC", subtype="PCM_16")
            flac = buf.getvalue()
            resp = web.StreamResponse(headers={"Content-Type": "audio/flac"})
            resp.content_length = len(flac)
            await resp.prepare(request)
            await self._sleep_until(t_recv + chunks[0][0] / 1000)
            await self._write(resp, flac, total, entry)
            entry["t_eof"], entry["t_eof_sent"] = entry["writes"][-1][0], entry["writes"][-1][2]
            await resp.write_eof()
            return resp
        content_type = {"pcm": "audio/pcm", "wav": "audio/wav", "sse": "text/event-stream"}[form]
        resp = web.StreamResponse(headers={"Content-Type": sc.get("content_type", content_type)})
        header = _wav_header(rate, sc.get("wav_data_size") or 0xFFFFFFFF) if form == "wav" else b""
        length_framed = sc.get("framing", "chunked") == "length"
        if length_framed:
            if form == "sse":
                raise ValueError("framing 'length' is for pcm and wav answers")
            # a body cut short (reset, hang) announces one more chunk than it sends
            resp.content_length = len(header) + sum(n for _, n in chunks) + (4800 if sc.get("after") in ("reset", "hang") else 0)
        await resp.prepare(request)
        if header:
            await resp.write(header)
        for i, (t_ms, n_bytes) in enumerate(chunks):
            await self._sleep_until(t_recv + t_ms / 1000)
            data = _pcm(n_bytes, i)
            if form == "sse":
                event = {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}
                data = f"event: speech.audio.delta\ndata: {json.dumps(event)}\n\n".encode()
            await self._write(resp, data, n_bytes, entry)
        after = sc.get("after", "eof")
        if after == "reset":
            request.transport.abort()
            return resp
        if after == "hang":
            await asyncio.sleep(3600)
        if form == "sse" and sc.get("sse_done", True):
            await resp.write(b'data: {"type": "speech.audio.done"}\n\n')
        if not length_framed or not chunks:  # the end of a chunked body is its own write
            entry["t_eof"] = perf_counter()
            await resp.write_eof()
            entry["t_eof_sent"] = perf_counter()
        else:  # that of a Content-Length body, its last write
            entry["t_eof"], entry["t_eof_sent"] = entry["writes"][-1][0], entry["writes"][-1][2]
            await resp.write_eof()
        return resp

    @staticmethod
    async def _write(resp: web.StreamResponse, data: bytes, n_audio: int, entry: dict) -> None:
        """Write, stamped right before and right after: the bytes leave in between."""
        t_before = perf_counter()
        await resp.write(data)
        entry["writes"].append([t_before, n_audio, perf_counter()])

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "scripted-tts", "object": "model"}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def upload_voice(self, request: web.Request) -> web.Response:
        form = await request.post()
        audio = form["audio_sample"]
        self.voices[form["name"]] = {"name": form["name"], "ref_text": form.get("ref_text"),
                                     "file_size": len(audio.file.read())}
        self._write_log({"upload": self.voices[form["name"]]})
        return web.json_response({"success": True, "voice": self.voices[form["name"]]})

    async def delete_voice(self, request: web.Request) -> web.Response:
        if self.voices.pop(request.match_info["name"], None) is None:
            return web.json_response({"error": {"message": "no such voice"}}, status=404)
        return web.json_response({"success": True})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/audio/speech", self.speech)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/audio/voices", self.upload_voice)
        app.router.add_delete("/v1/audio/voices/{name}", self.delete_voice)
        return app


@dataclass
class Running:
    url: str
    log_path: Path

    def log(self) -> list[dict]:
        """Everything the server logged so far (speech requests and uploads)."""
        if not self.log_path.exists():
            return []
        return [json.loads(line) for line in self.log_path.read_text(encoding="utf-8").splitlines() if line]

    def entries(self, texts, since: int = 0, timeout: float = 10.0) -> dict[str, dict]:
        """The latest log entry of each text, waiting for the server to log them: it logs a request
        just after its last byte, so a fast client may look before the line is there."""
        wanted, deadline = set(texts), time.monotonic() + timeout
        while True:
            found = {e["text"]: e for e in self.log()[since:] if e.get("text") in wanted}
            if len(found) == len(wanted) or time.monotonic() > deadline:
                return found
            time.sleep(0.02)


@contextlib.contextmanager
def running(script: dict, workdir: Path, tls: tuple[Path, Path] | None = None):
    """Start the server in its own process for a test or benchmark; stop it afterwards.
    `tls`: (certificate, key) PEM files to serve https."""
    workdir.mkdir(parents=True, exist_ok=True)
    script_path, log_path = workdir / "script.json", workdir / "server-log.jsonl"
    script_path.write_text(json.dumps(script), encoding="utf-8")
    tls_args = ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])] if tls else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.scripted_server", "--script", str(script_path), "--log", str(log_path),
         *tls_args],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)
    try:
        line = proc.stdout.readline()
        if not line.startswith("PORT "):
            raise RuntimeError(f"scripted server did not start: {line!r}")
        scheme = "https" if tls else "http"
        yield Running(f"{scheme}://127.0.0.1:{int(line.split()[1])}", log_path)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _main(script_path: str, log_path: str, port: int, tls: ssl.SSLContext | None) -> None:
    with open(script_path, encoding="utf-8") as f:
        script = json.load(f)
    runner = web.AppRunner(ScriptedServer(script, log_path).app(), access_log=None, handle_signals=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, backlog=1024, ssl_context=tls)
    await site.start()
    print(f"PORT {site._server.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--script", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--tls-cert", help="PEM certificate: serve https")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    args = parser.parse_args()
    context = None
    if args.tls_cert:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(args.tls_cert, args.tls_key)
    try:
        asyncio.run(_main(args.script, args.log, args.port, context))
    except KeyboardInterrupt:
        sys.exit(0)
