"""The HTTP server: OpenAI- and vllm-omni-compatible speech, voices, models, health and metrics.

The server listens at once; the engine loads and warms up in the background and /health turns 200 only
when it is ready. Every failure leaves as an OpenAI-style JSON error (errors.py), never a traceback, and a
client that goes away cancels its request so its batch slot frees within a step.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from pathlib import Path

import numpy as np
import orjson
from aiohttp import web

from serving.api import audio
from serving.api.errors import APIError, bad_request
from serving.api.metrics import ServerMetrics
from serving.api.protocol import Capabilities, SpeechRequest, parse_speaker_embedding, parse_speech_request
from serving.api.request_log import RequestLog
from serving.api.voices import VoiceError, VoiceStore
from serving.engine.engine import RequestFailed
from serving.engine.lru import LRU
from serving.engine.scheduler import QueueFullError

log = logging.getLogger("serving.api")

MAX_BODY_BYTES = 16 * 1024 * 1024  # a 10 MB clip as a base64 data URI, plus the JSON around it
MAX_VOICE_UPLOAD_BYTES = 10 * 1024 * 1024
URL_FETCH_TIMEOUT_S = 15
INLINE_CLIP_CACHE = 32  # decoded inline reference clips kept (by the data URI's text, or a hash of a URL's file)
# Request ids and unset seeds: neither is a secret, so no system call a request (uuid4's os.urandom, twice a request,
# let go of the interpreter and waited to take it back beside the engine's threads: ~7 of 45 py-spy samples of the
# handlers of a 64-clone burst on the development VM, docs/performance.md)
_RANDOM = random.Random()


class SpeechServer:
    """Binds an engine (serving.engine.engine.Engine or anything with its interface) to routes."""

    def __init__(self, engine, *, voices_dir: Path, api_key: str | None = None,
                 served_model_names: tuple[str, ...] = (), request_log: Path | None = None):
        self.engine = engine
        self.request_log = RequestLog(request_log) if request_log is not None else None
        self.api_key = api_key
        self.voices_dir = Path(voices_dir)
        self.served_model_names = served_model_names
        self.metrics = ServerMetrics(engine.stats)
        engine.observe = self.metrics.observe_phase
        self.voices: VoiceStore | None = None
        self.caps: Capabilities | None = None
        self.started_at = time.time()
        self._startup_error: str | None = None
        self._start_task: asyncio.Task | None = None
        self._clips = LRU(INLINE_CLIP_CACHE)  # (samples, voice key) of inline clips (_inline_clip)
        self._decoding: dict[str, asyncio.Future] = {}  # the clips being decoded, by the same key

    # --- app ----------------------------------------------------------------------------------------------
    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES,
                              middlewares=[self._error_middleware, self._auth_middleware])
        app.router.add_post("/v1/audio/speech", self.speech)
        app.router.add_get("/v1/audio/voices", self.list_voices)
        app.router.add_post("/v1/audio/voices", self.upload_voice)
        app.router.add_delete("/v1/audio/voices/{name}", self.delete_voice)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.on_startup.append(self._on_startup)
        app.on_shutdown.append(self._on_shutdown)
        return app

    async def _on_startup(self, _app) -> None:
        self._start_task = asyncio.get_running_loop().create_task(self._start_engine())

    async def _start_engine(self) -> None:
        try:
            await self.engine.start()
            info = self.engine.info
            self.caps = Capabilities(
                model_names=self.served_model_names or (info.model_name,),
                task_type=info.task_type,
                speakers=tuple(info.speakers),
                languages=tuple(info.languages),
                speaker_embedding_dim=info.speaker_embedding_dim,
                supports_instructions=info.supports_instructions,
                max_chunk_frames=info.chunk_frames,
                generation=info.generation,
            )
            self.voices = VoiceStore(self.voices_dir, reserved=self.caps.speakers)
            log.info("ready: %s (%s)", self.caps.model_names[0], info.task_type)
        except Exception as exc:  # surfaced by /health; the process keeps answering
            log.exception("engine failed to start")
            self._startup_error = f"{type(exc).__name__}: {exc}"

    async def _on_shutdown(self, _app) -> None:
        if self._start_task is not None and not self._start_task.done():
            self._start_task.cancel()
        await self.engine.shutdown()

    # --- middlewares --------------------------------------------------------------------------------------
    @web.middleware
    async def _error_middleware(self, request: web.Request, handler):
        endpoint = request.match_info.route.resource.canonical if request.match_info.route.resource else "other"
        try:
            response = await handler(request)
        except APIError as exc:
            response = exc.to_response()
        except web.HTTPException as exc:  # 404 route, 405 method, 413 body from aiohttp itself
            if exc.status == 413:
                message = f"request body too large (at most {MAX_BODY_BYTES // (1024 * 1024)} MB)"
            else:
                message = exc.reason or exc.text or "error"
            response = APIError(exc.status, message, code=exc.reason.lower().replace(" ", "_")
                                if exc.reason else None).to_response()
        except (asyncio.CancelledError, ConnectionResetError):
            self.metrics.requests.labels(endpoint, "499").inc()
            raise
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            response = APIError(500, "internal server error; the server logged the details",
                                code="internal_error").to_response()
        self.metrics.requests.labels(endpoint, str(response.status)).inc()
        return response

    @web.middleware
    async def _auth_middleware(self, request: web.Request, handler):
        if self.api_key and request.path.startswith("/v1/"):
            auth = request.headers.get("Authorization", "")
            if auth != f"Bearer {self.api_key}":
                raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                               code="invalid_api_key")
        return await handler(request)

    # --- readiness ----------------------------------------------------------------------------------------
    def _require_ready(self) -> Capabilities:
        if self._startup_error:
            raise APIError(503, f"the model failed to load: {self._startup_error}", code="model_load_failed")
        if self.engine.error:
            raise APIError(503, f"the engine stopped serving: {self.engine.error}", code="engine_failed")
        if self.caps is None or not self.engine.ready:
            raise APIError(503, "the model is still loading; retry shortly", code="model_loading",
                           headers={"Retry-After": "5"})
        return self.caps

    async def health(self, _request: web.Request) -> web.Response:
        if self._startup_error or self.engine.error:
            return web.json_response({"status": "error", "error": self._startup_error or self.engine.error},
                                     status=503)
        if self.caps is None or not self.engine.ready:
            return web.json_response({"status": "loading"}, status=503)
        return web.json_response({"status": "ok", "model": self.caps.model_names[0],
                                  "uptime_s": round(time.time() - self.started_at, 1),
                                  "engine": self.engine.config_dict()})

    async def models(self, _request: web.Request) -> web.Response:
        caps = self._require_ready()
        info = self.engine.info
        data = [{"id": caps.model_names[0], "object": "model", "created": int(self.started_at),
                 "owned_by": "ttsbench", "root": info.model_path, "task_type": info.task_type,
                 "speakers": list(caps.speakers), "languages": list(caps.languages),
                 "sample_rate": audio.SAMPLE_RATE, "max_batch_size": info.num_slots}]
        return web.json_response({"object": "list", "data": data})

    async def prometheus(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})

    # --- voices -------------------------------------------------------------------------------------------
    async def list_voices(self, _request: web.Request) -> web.Response:
        caps = self._require_ready()
        uploaded = [{k: v for k, v in meta.items() if k != "consent"} for meta in self.voices.list()]
        return web.json_response({"voices": list(caps.speakers), "uploaded_voices": uploaded})

    async def upload_voice(self, request: web.Request) -> web.Response:
        caps = self._require_ready()
        if not request.content_type.startswith("multipart/"):
            raise bad_request("upload a voice as multipart/form-data with fields name, consent, ref_text and "
                              "audio_sample (or speaker_embedding)", None, "invalid_content_type")
        fields, clip, clip_mime = await self._read_voice_form(request)
        name = fields.get("name", "").strip()
        if not name:
            raise bad_request("'name' is required", "name", "missing_required_parameter")
        consent = fields.get("consent", "").strip()
        if not consent:
            raise bad_request("'consent' is required: confirm the speaker agreed to be cloned", "consent",
                              "missing_required_parameter")
        ref_text = fields.get("ref_text", "").strip() or None
        embedding_field = fields.get("speaker_embedding")
        if (clip is None) == (embedding_field is None):
            raise bad_request("send exactly one of 'audio_sample' (a file) or 'speaker_embedding'", "audio_sample",
                              "missing_required_parameter")
        if caps.task_type != "Base":
            raise bad_request(f"voices can be cloned only by a Base checkpoint; this one does {caps.task_type}",
                              "audio_sample", "unsupported_task")
        loop = asyncio.get_running_loop()
        try:
            if clip is not None:
                samples = await loop.run_in_executor(None, self._decode_clip, clip, "audio_sample")
                meta = self.voices.add_audio(name, samples, source_bytes=len(clip), mime_type=clip_mime,
                                             ref_text=ref_text, consent=consent)
            else:
                embedding = self._parse_embedding_field(embedding_field, caps)
                meta = self.voices.add_embedding(name, embedding, ref_text=ref_text, consent=consent)
        except VoiceError as exc:
            raise APIError(exc.status, str(exc), param=exc.param, code="invalid_voice") from None
        meta = {k: v for k, v in meta.items() if k != "consent"}
        return web.json_response({"success": True, "voice": meta})

    async def _read_voice_form(self, request: web.Request) -> tuple[dict[str, str], bytes | None, str]:
        try:
            reader = await request.multipart()
        except Exception as exc:  # malformed multipart framing
            raise bad_request(f"malformed multipart body: {exc}", None, "invalid_multipart") from None
        fields: dict[str, str] = {}
        clip, clip_mime = None, "application/octet-stream"
        try:
            async for part in reader:
                if part.name in ("audio_sample", "file", "audio"):
                    data = bytearray()
                    while chunk := await part.read_chunk(64 * 1024):
                        data += chunk
                        if len(data) > MAX_VOICE_UPLOAD_BYTES:
                            raise APIError(413, "audio_sample is larger than 10 MB", param="audio_sample",
                                           code="file_too_large")
                    clip = bytes(data)
                    clip_mime = part.headers.get("Content-Type", clip_mime)
                elif part.name:
                    fields[part.name] = (await part.read(decode=True)).decode("utf-8", errors="replace")
        except (ValueError, AssertionError) as exc:
            raise bad_request(f"malformed multipart body: {exc}", None, "invalid_multipart") from None
        return fields, clip, clip_mime

    @staticmethod
    def _parse_embedding_field(raw: str, caps: Capabilities) -> np.ndarray:
        try:
            values = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise bad_request("'speaker_embedding' must be a JSON list of numbers", "speaker_embedding",
                              "invalid_type") from None
        return np.asarray(parse_speaker_embedding(values, caps), dtype=np.float32)

    async def delete_voice(self, request: web.Request) -> web.Response:
        self._require_ready()
        name = request.match_info["name"]
        try:
            deleted = self.voices.delete(name)
        except VoiceError:
            deleted = False
        if not deleted:
            raise APIError(404, f"voice {name!r} not found", param="name", code="voice_not_found")
        return web.json_response({"success": True, "name": name.lower(), "deleted": True})

    # --- speech -------------------------------------------------------------------------------------------
    async def speech(self, request: web.Request) -> web.StreamResponse:
        caps = self._require_ready()
        t_arrival = time.monotonic()
        raw = await request.read()
        try:
            body = orjson.loads(raw)  # a clone body (a ~235 kB clip inline): ~65 us, json.loads ~150 (VM)
        except orjson.JSONDecodeError as exc:  # invalid UTF-8 too
            raise bad_request(f"request body is not valid JSON: {exc}", None, "invalid_json") from None
        req = parse_speech_request(body, caps, max_chunk_frames=self.engine.info.chunk_frames)
        gen = await self._generation_request(req)
        try:
            stream = await self.engine.submit(gen)
            self.engine.observe("accept", time.monotonic() - t_arrival)
        except QueueFullError as exc:
            retry = str(self.engine.retry_after_s())
            raise APIError(503, f"server over capacity: {exc}; retry after {retry} s", code="server_busy",
                           headers={"Retry-After": retry}) from None
        except ValueError as exc:  # e.g. a prompt longer than the KV cache holds
            raise bad_request(str(exc), "input") from None
        except RequestFailed as exc:  # the engine stopped serving (Engine.error)
            raise APIError(exc.status, str(exc), code="engine_failed") from None
        headers = {"X-Request-Id": gen.request_id, "X-Sample-Rate": str(audio.SAMPLE_RATE),
                   "X-Seed": str(gen.sampling.seed)}
        try:
            if req.stream:
                return await self._stream_response(request, req, stream, headers, t_arrival)
            return await self._whole_response(req, stream, headers, t_arrival)
        except RequestFailed as exc:  # before any audio went out, so the status can still say so
            raise APIError(exc.status, str(exc), param="input" if exc.status == 400 else None,
                           code="generation_failed") from None
        finally:
            outcome = "failed" if stream.error is not None else "ok" if stream.finished else "cancelled"
            if not stream.finished:
                stream.cancel()
                self.metrics.cancelled.inc()
            if self.request_log is not None:
                stream.mark("end", time.monotonic())
                self.request_log.write(stream, t_arrival, outcome)

    async def _whole_response(self, req: SpeechRequest, stream, headers: dict, t_arrival: float) -> web.Response:
        pieces = []
        async for chunk in stream:
            if not pieces:
                self.metrics.first_audio.observe(time.monotonic() - t_arrival)
            pieces.append(chunk)
        samples = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
        samples = audio.time_stretch(samples, req.speed)
        loop = asyncio.get_running_loop()
        body = await loop.run_in_executor(None, audio.encode, samples, req.response_format)
        self._observe_end(t_arrival, len(samples))
        headers["X-Audio-Seconds"] = f"{len(samples) / audio.SAMPLE_RATE:.3f}"
        return web.Response(body=body, headers={**headers, "Content-Type": audio.CONTENT_TYPES[req.response_format]})

    async def _stream_response(self, request: web.Request, req: SpeechRequest, stream, headers: dict,
                               t_arrival: float) -> web.StreamResponse:
        sse = req.stream_format == "sse"
        content_type = "text/event-stream" if sse else audio.CONTENT_TYPES[req.response_format]
        response = web.StreamResponse(headers={**headers, "Content-Type": content_type, "Cache-Control": "no-cache"})
        response.enable_chunked_encoding()
        n_samples = 0
        first = True
        chunks = aiter(stream)
        while True:
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                break
            except RequestFailed as exc:
                if first:
                    raise
                log.error("request %s failed mid-stream: %s", headers["X-Request-Id"], exc)
                if sse:  # an OpenAI-style error event, and no speech.audio.done
                    await response.write(audio.sse_event({"type": "error", "error": {
                        "message": str(exc), "type": "server_error", "code": "generation_failed"}}))
                    await response.write_eof()
                elif request.transport is not None:
                    # no final chunk: the client sees a broken body, never a short answer that looks complete
                    request.transport.abort()
                return response
            chunk = audio.time_stretch(chunk, req.speed)
            pcm = audio.to_pcm16(chunk)
            if first:
                self.metrics.first_audio.observe(time.monotonic() - t_arrival)
                await response.prepare(request)
                if req.response_format == "wav" and not sse:
                    await response.write(audio.wav_header(None))
                first = False
            await response.write(audio.sse_delta(pcm) if sse else pcm)
            stream.mark("first_sent", time.monotonic())
            n_samples += len(chunk)
        if first:  # no audio at all (end of speech at once): still a valid, empty stream
            await response.prepare(request)
            if req.response_format == "wav" and not sse:
                await response.write(audio.wav_header(None))
        if sse:
            await response.write(audio.sse_done({"audio_seconds": round(n_samples / audio.SAMPLE_RATE, 3),
                                                 "frames": stream.frames}))
        await response.write_eof()
        self._observe_end(t_arrival, n_samples)
        return response

    def _observe_end(self, t_arrival: float, n_samples: int) -> None:
        self.metrics.e2e.observe(time.monotonic() - t_arrival)
        self.metrics.audio_seconds.inc(n_samples / audio.SAMPLE_RATE)

    async def _generation_request(self, req: SpeechRequest):
        """Resolve voices and reference audio (the I/O part of validation) into the engine's request."""
        from serving.engine.request import GenerationRequest, SamplingParams

        ref_audio = embedding = None
        ref_text = req.ref_text
        voice_key = None
        x_vector_only = req.x_vector_only_mode
        if req.task_type == "Base":
            if req.speaker_embedding is not None:
                embedding = np.asarray(req.speaker_embedding, dtype=np.float32)
            elif req.ref_audio is not None and _looks_inline(req.ref_audio):
                ref_audio, voice_key = await self._inline_clip(req.ref_audio)
            else:
                name = req.ref_audio if req.ref_audio is not None else req.voice
                voice = self.voices.get(name)
                if voice is None:
                    known = ", ".join(self.voices.names()) or "none uploaded"
                    param = "ref_audio" if req.ref_audio is not None else "voice"
                    raise bad_request(f"unknown voice {name!r}: not an uploaded voice ({known}), a data: URI or "
                                      "an http(s) URL", param, "unknown_voice")
                voice_key = voice.key
                ref_audio, embedding = voice.audio, voice.embedding
                ref_text = ref_text or voice.ref_text
                if embedding is not None:
                    x_vector_only = True
            if not x_vector_only and not ref_text:
                raise bad_request("voice cloning needs 'ref_text' (the transcript of the reference audio), or "
                                  "x_vector_only_mode=true", "ref_text", "missing_required_parameter")
        seed = req.seed if req.seed is not None else _RANDOM.getrandbits(56)
        sampling = SamplingParams(
            temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
            repetition_penalty=req.repetition_penalty, do_sample=req.do_sample,
            subtalker_temperature=req.subtalker_temperature, subtalker_top_k=req.subtalker_top_k,
            subtalker_top_p=req.subtalker_top_p, subtalker_do_sample=req.subtalker_do_sample, seed=seed)
        return GenerationRequest(
            task=req.task_type, text=req.input, language=req.language, speaker=req.voice if
            req.task_type == "CustomVoice" else None, instructions=req.instructions, ref_audio=ref_audio,
            ref_text=ref_text if not x_vector_only else None, speaker_embedding=embedding,
            x_vector_only=x_vector_only, voice_key=voice_key, non_streaming_mode=req.non_streaming_mode,
            max_new_tokens=req.max_new_tokens, first_chunk_frames=req.initial_codec_chunk_frames,
            sampling=sampling, request_id=f"speech-{_RANDOM.getrandbits(64):016x}")

    async def _inline_clip(self, ref: str) -> tuple[np.ndarray, str]:
        """(samples, voice key) of a data: URI or URL clip. Clients that clone over this API resend the same
        reference with every request, so both the decoded samples (here) and the engine's encoding of them (the
        voice key, a hash of the clip) are cached: a repeat costs a dictionary lookup, not a decode, a resample
        and the speaker and codec encoders. Measured on an H100 at 128 concurrent clones, this handler's share
        (phase accept) was 390 ms per request while every clip was decoded anew (docs/performance.md). A data: URI
        is looked up by its text, which Python hashes without letting go of the interpreter (~50 us for a 175 kB
        WAV's URI on the development VM, where its sha256 took ~140 us and let go of it: the handler then waited
        to take the interpreter back beside the engine's busy threads); its sha256, the voice key, is computed once,
        off the loop, with its decoding. A URL is keyed by a hash of the file it fetched. Requests that bring a
        clip while it is being decoded wait for that decoding: a burst's requests all arrive before the first
        decoding ends, and each decoded its clip anew (a first wave of 128 clones of 8 voices: 128 decodings,
        accept 86 / 116 ms p50 / p95 on an H100 host, against 0.1 for custom voice)."""
        if ref.startswith(("http://", "https://")):
            data = await _fetch_url(ref)
            voice_key = "inline:" + hashlib.sha256(data).hexdigest()
            key, decode = voice_key, lambda: (self._decode_clip(data, "ref_audio"), voice_key)
        else:
            key, decode = ref, lambda: self._decode_inline(ref)
        clip = self._clips.get(key)
        if clip is not None:
            return clip
        decoding = self._decoding.get(key)
        if decoding is None:
            decoding = asyncio.get_running_loop().run_in_executor(None, decode)
            self._decoding[key] = decoding
            decoding.add_done_callback(lambda done: self._decoded(key, done))
        # shielded: a client that leaves cancels its own wait, not the decoding the others wait for
        return await asyncio.shield(decoding)

    def _decoded(self, key: str, done: asyncio.Future) -> None:
        del self._decoding[key]
        if not done.cancelled() and done.exception() is None:
            self._clips.put(key, done.result())

    def _decode_inline(self, ref: str) -> tuple[np.ndarray, str]:
        """(samples, voice key) of a data: URI or bare base64 clip (off the loop)."""
        try:
            data = audio.decode_data_uri(ref)
        except audio.AudioError as exc:
            raise bad_request(str(exc), "ref_audio", "invalid_audio") from None
        if len(data) > MAX_VOICE_UPLOAD_BYTES:
            raise APIError(413, "ref_audio is larger than 10 MB", param="ref_audio", code="file_too_large")
        return self._decode_clip(data, "ref_audio"), "inline:" + hashlib.sha256(ref.encode()).hexdigest()

    @staticmethod
    def _decode_clip(data: bytes, param: str) -> np.ndarray:
        try:
            return audio.decode_clip(data)
        except audio.AudioError as exc:
            raise bad_request(str(exc), param, "invalid_audio") from None


def _looks_inline(ref: str) -> bool:
    """data: URIs, URLs and long base64 strings are clips; anything else names an uploaded voice."""
    return ref.startswith(("data:", "http://", "https://")) or len(ref) > 64


async def _fetch_url(url: str) -> bytes:
    import aiohttp

    try:
        timeout = aiohttp.ClientTimeout(total=URL_FETCH_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(url) as resp:
                if resp.status != 200:
                    raise bad_request(f"ref_audio URL answered HTTP {resp.status}", "ref_audio", "invalid_audio")
                data = bytearray()
                async for chunk in resp.content.iter_chunked(64 * 1024):
                    data += chunk
                    if len(data) > MAX_VOICE_UPLOAD_BYTES:
                        raise APIError(413, "ref_audio is larger than 10 MB", param="ref_audio",
                                       code="file_too_large")
                return bytes(data)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise bad_request(f"could not fetch ref_audio URL: {exc or type(exc).__name__}", "ref_audio",
                          "invalid_audio") from None


def run_server(server: SpeechServer, host: str, port: int) -> None:
    """Serve until interrupted. Handler cancellation makes a client disconnect cancel its request."""
    web.run_app(server.make_app(), host=host, port=port, handler_cancellation=True, print=None,
                access_log=None, shutdown_timeout=5)

