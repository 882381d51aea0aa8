"""The two-stage engine: talker + code predictor (stage 0) and codec (stage 1), joined by async queues.

Both stages are asyncio tasks on the engine's own event loop, in its own thread, that hand their tensor work
to their own single-thread executor (one per device), so the engine's loop keeps all bookkeeping
single-threaded while the two stages compute at the same time: the talker never waits for the codec. Between
talker steps, cancelled and finished requests leave (their KV slot is free for the very next step) and
waiting ones are admitted.

The engine's loop is not the HTTP server's: a step's launch and its codes each take a turn of the loop, and
on the server's loop that turn waited behind every handler ready before it. A burst of voice clones (~235 kB
bodies, ~1.7 ms of parsing each) held a first wave's prefill of 6 prompts for 192 ms on an H100 host
(docs/performance.md). Requests, their acceptance, each stream's audio and its cancellation cross between the
loops through each loop's Mailbox: one wake-up of a loop per batch of calls, not one a call.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Callable

import numpy as np

from serving.engine.codec_graphs import CodecGraphReport
from serving.engine.codec_stage import CodecStream, next_batch
from serving.engine.mailbox import Mailbox
from serving.engine.request import GenerationRequest
from serving.engine.scheduler import QueueFullError, Scheduler
from serving.model.config import SAMPLE_RATE, GenerationDefaults

log = logging.getLogger("serving.engine")

RECENT_FRAMES_S = 5.0  # the window of stats()' frames_per_second
# Threads that encode new reference voices side by side, sharing the TorchScript encoders (each call lets go of the
# interpreter for the whole network). On an H100 beside two busy launching threads, 1 / 2 / 3 / 4 threads encoded
# 41.4 / 75.2 / 121.5 / 142.8 new voices a second (spawned processes no better); served fresh clone, four threads
# against two on one machine: c=32 TTFAB p95 504.7 -> 345.6 ms, c=128 1266.6 -> 1044.5 (docs/performance.md, s41).
VOICE_THREADS = 4

# A request's milestones in the order it meets them, each the monotonic time it first happened (--request-log).
TIMELINE = {
    "submit": "the handler hands the request to the engine",
    "admitted": "it takes a KV slot; its prefill starts (with the others admitted at once)",
    "prefilled": "its prefill is done (admitted while a step is in flight and not in a burst: its prompt is built, the "
                 "prefill rides the next step, which draws its first frame where it carries the prompt)",
    "first_due": "the frames of its first chunk are all generated",
    "first_codec_start": "the codec call of its first chunk starts",
    "first_codec_end": "that call's waveforms are on the host",
    "first_taken": "its HTTP handler takes the first chunk",
    "first_sent": "(server) the handler has written the first chunk",
    "last_frame": "its last frame is generated",
    "last_codec_start": "the codec call of its last chunk starts",
    "last_codec_end": "that call's waveforms are on the host",
    "end": "(server) the response is complete, failed, or its client left",
}

# Where a request's time goes, in the order a request meets them, each observed in seconds through
# Engine.observe (the server exports them as the histogram ttsbench_engine_phase_seconds): first audio =
# accept + queue + prefill + first_frames + codec_wait + codec_call + deliver of its first chunk, plus the
# network and the HTTP parsing before the handler starts.
PHASES = {
    "accept": "(server) the request's handler starts -> submitted: body, parsing, reference audio (per request)",
    "voice": "a voice clone's reference new to the server: submitted -> encoded (speaker and codec encoders, on "
             "a voice thread beside the talker's steps; per new voice)",
    "queue": "request submitted -> admitted to a KV slot, its voice's encoding included (per request)",
    "prefill": "the prefill of the requests admitted together: graphs or batched passes (per admission); while a step "
               "is in flight, unless a burst, their prompts' build only (the prefill rides the next step: in "
               "first_frames)",
    "first_frames": "prefill done -> the frames of the first chunk generated (per request)",
    "talker_step": "one decode step's codes on the host, timed from the later of its launch and the previous "
                   "step's codes: the pace of frames, prefills run in between included (per step)",
    "codec_wait": "a chunk's frames all generated -> its codec call starts (per chunk)",
    "codec_call": "one batched codec call, codes in to waveforms on the host (per call)",
    "deliver": "a chunk's waveform ready -> its HTTP handler takes it (per chunk): the hop to the server's loop and "
               "that loop's lag",
}


@dataclass(frozen=True)
class EngineConfig:
    model: str  # checkpoint directory (already resolved)
    model_name: str = ""  # the id /v1/models lists (default: the directory name)
    load_format: str = "auto"  # auto: read the weights; dummy: random weights of the checkpoint's shapes
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    talker_device: str = "auto"  # auto: cuda if available, else cpu
    codec_device: str = "auto"  # auto: the talker's device
    max_batch_size: int = 32
    max_queue: int = 64
    kv_cache_gb: float | None = None  # None: 40% of free GPU memory, or 2 GiB on CPU
    max_model_len: int = 4096  # the KV slot's length: prompt + generated frames + 1 spare (see TalkerRunner._prefill_many)
    chunk_frames: int = 25
    first_chunk_frames: int = 2
    left_context_frames: int = 72  # voice clone: last reference frames that prime the codec's state (all: exact)
    max_codec_batch: int = 64
    codec_batch_wait_ms: float = 100.0  # most a chunk whose listener has audio in hand waits to share a codec call
    enforce_eager: bool = False  # no CUDA graphs (a CPU never uses them)
    compile: bool | None = None  # torch.compile the talker layers; None: with graphs
    max_graph_batch: int = 128  # largest batch bucket with captured graphs; bigger steps run eagerly
    ignore_eos: bool = False  # benchmark mode for random weights: stop by length_policy, never at eos
    length_policy: str = "text"  # with ignore_eos: text (spoken length of the input) or max-new-tokens
    codec_dtype: str = "auto"  # the codec decoder's weights and state; auto: bfloat16 on CUDA (as the official loads it), float32 on CPU
    codec_graph_batches: tuple[int, ...] | None = None  # codec graph batch buckets; None: 1, 2, 3, 4, 6, 8, ... max_codec_batch
    codec_graph_memory_gb: float | None = None  # most memory codec graphs may take (None: no limit)

    def __post_init__(self):
        for name in ("max_batch_size", "chunk_frames", "first_chunk_frames", "max_model_len", "max_codec_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.max_queue < 0 or self.left_context_frames < 0 or self.codec_batch_wait_ms < 0:
            raise ValueError("max_queue, left_context_frames and codec_batch_wait_ms must be >= 0")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError("load_format must be auto or dummy")
        if self.max_graph_batch < 1:
            raise ValueError("max_graph_batch must be at least 1")
        if self.codec_graph_memory_gb is not None and self.codec_graph_memory_gb < 0:
            raise ValueError("codec_graph_memory_gb must be >= 0")
        from serving.engine.codec_graphs import make_batch_buckets

        make_batch_buckets(self.max_codec_batch, self.codec_graph_batches)  # raises for sizes no call can have
        from serving.engine.length_policy import POLICIES

        if self.length_policy not in POLICIES:
            raise ValueError(f"length_policy must be one of {', '.join(POLICIES)}")


@dataclass(frozen=True)
class EngineInfo:
    """What the API needs to know about the loaded checkpoint."""

    model_name: str
    model_path: str
    task_type: str  # CustomVoice | VoiceDesign | Base
    speakers: tuple[str, ...]
    languages: tuple[str, ...]
    speaker_embedding_dim: int | None
    supports_instructions: bool
    chunk_frames: int
    num_slots: int
    generation: GenerationDefaults  # the checkpoint's generation_config.json: request defaults
    codec_graphs: CodecGraphReport | None = None  # set once the codec's graphs are captured (None: eager codec)


class RequestFailed(Exception):
    """The engine could not serve a request it had accepted. status 400: the request's fault (e.g. its prompt
    does not fit a KV slot); 500: the server's; 503: shutting down."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


def _settle(future: asyncio.Future, error: Exception | None) -> None:
    if not future.done():  # else its handler was cancelled meanwhile
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


class RequestStream:
    """The audio of one request, chunk by chunk, as an async iterator of float32 arrays."""

    def __init__(self, engine: "Engine", request: GenerationRequest, reader: asyncio.AbstractEventLoop):
        self.engine = engine
        self.request = request
        self.queue: asyncio.Queue = asyncio.Queue()  # read on `reader`, the loop of the request's handler
        self._reader = Mailbox.of(reader)
        self.frames = 0
        self.finished = False  # every chunk was delivered
        self.cancelled = False
        self.error: Exception | None = None  # why the engine failed it
        self.slot: int | None = None
        self.max_frames = request.max_new_tokens  # lowered at prefill when the prompt leaves less room
        self.codec: CodecStream | None = None
        self.voice_pending = False  # its reference voice is being encoded; until then it waits for a slot
        # Its way through the engine (the phases' starts, and --request-log): monotonic time of each milestone
        # (TIMELINE), and the batch sizes it met (prefill_batch: requests prefilled together, running: rows
        # decoding when it was admitted, first_codec_batch: rows of the codec call of its first chunk).
        self.marks: dict[str, float] = {"submit": time.monotonic()}
        self.batches: dict[str, int] = {}

    def mark(self, name: str, at: float) -> None:
        self.marks.setdefault(name, at)

    def put(self, item) -> None:
        """Hand the reader a chunk (waveform, when ready), None at the end, or an exception (the engine's thread)."""
        self.to_reader(self.queue.put_nowait, item)

    def to_reader(self, fn, *args) -> None:
        """Run fn(*args) on the reader's loop (from the engine's thread)."""
        try:
            self._reader.post(fn, *args)
        except RuntimeError:  # the reader's loop is closed: nobody is left to read
            pass

    def __aiter__(self):
        return self

    async def __anext__(self) -> np.ndarray:
        item = await self.queue.get()
        if isinstance(item, tuple):  # (waveform, when it was ready)
            now = time.monotonic()
            self.engine.observe("deliver", now - item[1])
            self.mark("first_taken", now)
            return item[0]
        if item is None:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, Exception):
            self.finished = True
            self.error = item
            raise item
        return item

    def cancel(self) -> None:
        """Stop generating: the slot frees before the next talker step."""
        if not self.cancelled and not self.finished:
            self.cancelled = True
            try:
                self.engine._inbox.post(self.engine._on_cancel, self)
            except RuntimeError:  # the engine's loop is closed: shut down, its slots are gone
                pass


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.ready = False
        self.error: str | None = None  # why the engine stopped serving (a stage's loop failed: _stage_ended)
        self.info: EngineInfo | None = None
        self.runner = None  # TalkerRunner, built in start()
        self.codec = None  # CodecRunner
        self.scheduler: Scheduler[RequestStream] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the engine's own loop, run by self._thread
        self._inbox: Mailbox | None = None  # requests and cancellations for that loop, from the handlers' loops
        self._thread: threading.Thread | None = None
        self._talker_pool = ThreadPoolExecutor(1, thread_name_prefix="talker")
        self._codec_pool = ThreadPoolExecutor(1, thread_name_prefix="codec")
        self._voice_pool = ThreadPoolExecutor(VOICE_THREADS, thread_name_prefix="voices")  # new voices' encoders
        self._voice_tasks: set[asyncio.Task] = set()  # requests waiting on their voice
        self._voice_jobs: dict[str, asyncio.Future] = {}  # the voices being encoded, by voice key
        self._wake_talker = asyncio.Event()
        self._wake_codec = asyncio.Event()
        self._codec_streams: list[RequestStream] = []
        self._tasks: list[asyncio.Task] = []
        self._frames_total = 0
        self._slot_moves = 0  # requests moved to lower KV slots (Scheduler.compact)
        self._recent_frames: deque[tuple[float, int]] = deque()
        self._recent_e2e: deque[float] = deque(maxlen=64)
        self._stopping = False
        self.startup_s: dict[str, float] = {}  # seconds of start-up by phase (load, warm-ups), once started
        self.observe: Callable[[str, float], None] = lambda phase, seconds: None  # see PHASES; the server's metrics

    # --- lifecycle ---------------------------------------------------------------------------------------
    async def _on_engine_loop(self, coro):
        """Run a coroutine on the engine's loop and wait for it from the caller's loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def start(self) -> None:
        """Start the engine's loop in its thread; there, load both stages (each on its own thread and device),
        warm them up, then start the stages' loops."""
        self._loop = asyncio.new_event_loop()
        self._inbox = Mailbox.of(self._loop)
        self._thread = threading.Thread(target=self._loop.run_forever, name="engine", daemon=True)
        self._thread.start()
        await self._on_engine_loop(self._start())

    async def _start(self) -> None:
        from serving.engine.loader import load_stages

        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        self.runner, self.codec, self.info = await loop.run_in_executor(self._talker_pool, load_stages, self.config)
        self.scheduler = Scheduler(self.runner.num_slots, self.config.max_queue, self.runner.buckets,
                                   ready=lambda stream: not stream.voice_pending)
        t1 = time.monotonic()
        await loop.run_in_executor(self._talker_pool, self.runner.warmup)
        t2 = time.monotonic()
        await loop.run_in_executor(self._codec_pool, self.codec.warmup,
                                   (self.config.first_chunk_frames, self.config.chunk_frames),
                                   self.config.left_context_frames if self.info.task_type == "Base" else 0)
        t3 = time.monotonic()
        self.startup_s = {"load": round(t1 - t0, 1), "talker_warmup": round(t2 - t1, 1),
                          "codec_warmup": round(t3 - t2, 1), "total": round(t3 - t0, 1)}
        log.info("engine started in %.1f s: load %.1f, talker warm-up %.1f (%s), codec warm-up %.1f", t3 - t0, t1 - t0,
                 t2 - t1, ", ".join(f"{k} {v}" for k, v in self.runner.warmup_s.items()), t3 - t2)
        self.info = replace(self.info, codec_graphs=self.codec.graph_report)
        # Loading, compiling and capturing leave millions of long-lived Python objects; a full collection that
        # scans them all stalls every thread for hundreds of ms, mid-burst. Moved out of the collector's reach,
        # they cost nothing; what serving allocates is still collected.
        gc.collect()
        gc.freeze()
        self._tasks = [loop.create_task(self._talker_loop(), name="talker"),
                       loop.create_task(self._codec_loop(), name="codec")]
        for task in self._tasks:
            task.add_done_callback(self._stage_ended)
        self.ready = True

    def _stage_ended(self, task: asyncio.Task) -> None:
        """A stage's loop that ends by an error while serving (a bug: the calls that may fail are guarded) stops
        the engine: every request in it fails and new ones are refused (503; /health says why), where they would
        otherwise wait for audio that never comes while the server looked healthy."""
        if self._stopping or task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        log.error("the engine's %s loop failed; the engine serves nothing more", task.get_name(), exc_info=exc)
        self.error = f"the {task.get_name()} stage failed: {type(exc).__name__}: {exc}"
        self.ready = False
        for other in self._tasks:
            other.cancel()
        failed = RequestFailed(f"generation failed: {self.error}")
        streams = list(self.scheduler.waiting) + [s for _, s in self.scheduler.running()] + self._codec_streams
        for stream in dict.fromkeys(streams):
            stream.put(failed)

    async def shutdown(self) -> None:
        if self._loop is None or self._loop.is_closed():  # never started, or already shut down
            return
        try:
            await self._on_engine_loop(self._shutdown())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
            self._loop.close()

    async def _shutdown(self) -> None:
        self._stopping = True
        self.ready = False
        for task in self._tasks + list(self._voice_tasks):
            task.cancel()
        for task in self._tasks + list(self._voice_tasks):
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        if self.scheduler is not None:
            for stream in list(self.scheduler.waiting) + [s for _, s in self.scheduler.running()]:
                stream.put(RequestFailed("the server is shutting down", 503))
        self._talker_pool.shutdown(wait=True, cancel_futures=True)
        self._codec_pool.shutdown(wait=True, cancel_futures=True)
        self._voice_pool.shutdown(wait=True, cancel_futures=True)

    def config_dict(self) -> dict:
        """The configuration, what the stages made of it, and how long start-up took, by phase."""
        d = asdict(self.config)
        if self.startup_s:
            d["startup_s"] = self.startup_s
        if self.runner is not None:
            d.update(self.runner.describe())
        if self.codec is not None:
            d.update(self.codec.describe())
        return d

    # --- requests ----------------------------------------------------------------------------------------
    async def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue a request; its stream is read on the caller's loop. Raises QueueFullError when over capacity,
        ValueError when it cannot fit, RequestFailed (503) once the engine has stopped serving."""
        if self.error is not None:
            raise RequestFailed(f"the engine stopped serving: {self.error}", 503)
        if not self.ready:
            raise QueueFullError("the engine is not ready")
        if request.max_new_tokens >= self.config.max_model_len:
            raise ValueError(f"max_new_tokens {request.max_new_tokens} leaves no room for the prompt in "
                             f"--max-model-len {self.config.max_model_len}")
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request, loop)
        accepted = loop.create_future()
        self._inbox.post(self._submit, stream, accepted)
        try:
            await accepted
        except asyncio.CancelledError:  # its client left meanwhile: queued or not, the engine lets it go
            stream.cancel()
            raise
        return stream

    def _submit(self, stream: RequestStream, accepted: asyncio.Future) -> None:
        """Queue a stream (on the engine's loop) and tell its handler whether it was accepted."""
        error = None
        try:
            if not stream.cancelled:  # else its client left before the engine's loop got to it
                self.scheduler.submit(stream)  # QueueFullError when over capacity
                if self.runner.needs_voice(stream.request):
                    stream.voice_pending = True
                    task = self._loop.create_task(self._await_voice(stream, self._voice_job(stream.request)))
                    self._voice_tasks.add(task)
                    task.add_done_callback(self._voice_tasks.discard)
                self._wake_talker.set()
        except Exception as exc:  # the handler answers it; it must never wait for an answer that is not coming
            error = exc
        stream.to_reader(_settle, accepted, error)

    def _voice_job(self, request: GenerationRequest) -> asyncio.Future:
        """The encoding of a request's new voice on a voice thread, one per voice: the requests of a voice that
        is being encoded (a burst's, all sent with the same clip) wait for the same job."""
        key = request.voice_key
        job = self._voice_jobs.get(key) if key is not None else None
        if job is None:
            t0 = time.monotonic()
            job = asyncio.get_running_loop().run_in_executor(self._voice_pool, self.runner.encode_voice, request)
            job.add_done_callback(lambda done: self._voice_done(key, done, t0))
            if key is not None:
                self._voice_jobs[key] = job
        return job

    def _voice_done(self, key: str | None, job: asyncio.Future, t0: float) -> None:
        if key is not None:
            del self._voice_jobs[key]
        if job.cancelled():
            return
        if job.exception() is None:
            self.observe("voice", time.monotonic() - t0)
        elif not isinstance(job.exception(), ValueError):
            log.error("encoding a reference voice failed", exc_info=job.exception())

    async def _await_voice(self, stream: RequestStream, job: asyncio.Future) -> None:
        """Let a request take a slot once its voice is encoded. The talker keeps stepping meanwhile and admits
        ready requests that came later."""
        try:
            voice = await job  # a client that leaves does not cancel this task: only shutdown does
        except Exception as exc:
            if self.scheduler.remove_waiting(stream):  # else its client left
                self._fail(stream, RequestFailed(str(exc), 400) if isinstance(exc, ValueError)
                           else RequestFailed(f"encoding the reference audio failed: {type(exc).__name__}"))
            return
        stream.request.encoded_voice = voice
        stream.voice_pending = False
        self._wake_talker.set()

    def _on_cancel(self, stream: RequestStream) -> None:
        if self.scheduler.remove_waiting(stream):
            stream.finished = True
        self._wake_talker.set()  # the talker loop frees the slot before its next step

    def retry_after_s(self) -> int:
        """A hint for 503s: how long the queue ahead takes to drain at the recent pace."""
        mean_e2e = sum(self._recent_e2e) / len(self._recent_e2e) if self._recent_e2e else 1.0
        waves = (self.scheduler.num_waiting + 1) / max(1, self.scheduler.num_slots)
        return max(1, min(60, math.ceil(mean_e2e * waves)))

    def stats(self) -> dict[str, float]:
        """Read from the server's thread: copies of the engine's lists (a copy in C holds the interpreter, so
        the engine's thread cannot change one halfway)."""
        if self.scheduler is None:
            return {}
        now = time.monotonic()
        frames = [(t, n) for t, n in list(self._recent_frames) if now - t <= RECENT_FRAMES_S]
        span = (now - frames[0][0]) if len(frames) > 1 else 0.0
        recent = sum(n for _, n in frames)
        return {
            "queue_depth": self.scheduler.num_waiting,
            "running": self.scheduler.num_running,
            "kv_slots_total": self.scheduler.num_slots,
            "kv_slots_free": self.scheduler.num_free,
            "frames_per_second": recent / span if span > 0 else 0.0,
            "frames_total": self._frames_total,
            "slot_moves_total": self._slot_moves,
            "codec_pending_frames": sum(len(s.codec.pending) for s in list(self._codec_streams)),
            "codec_frames_decoded": self.codec.frames_decoded,
            "codec_frames_computed": self.codec.frames_computed,
            "codec_frames_padding_rows": self.codec.frames_padding_rows,
        }

    # --- stage 0: talker ---------------------------------------------------------------------------------
    async def _talker_loop(self) -> None:
        """Admit, prefill, launch the next step, then hand out the previous step's codes while it computes.

        One step stays in flight: step N+1 is queued on the GPU before step N's codes are dealt to their
        streams, so that host work (this loop, the HTTP handlers between steps) overlaps the GPU instead of
        leaving it idle between frames. A request that ended at step N has run step N+1 too; those codes are
        dropped, since each step remembers which stream held each slot when it was launched. Requests admitted
        while a step is in flight beside running ones are staged (TalkerRunner.stage): their prefill rides step
        N+1, which draws their first frame (where it cannot carry their prompts, their passes follow it, they sit
        it out and join at step N+2); the running streams never wait for a prefill of its own. A burst (a level's
        first wave) is prefilled at once instead, and joins step N+1."""
        loop = asyncio.get_running_loop()
        sched = self.scheduler
        inflight = None  # (handle, rows, launched at) of the step whose codes are not read yet
        last_codes = 0.0  # when the previous step's codes reached the host
        while not self._stopping:
            self._drop_cancelled()
            if inflight is None and sched.num_running == 0 and sched.num_ready == 0:  # idle, or voices encoding
                self._wake_talker.clear()
                await self._wake_talker.wait()
                continue
            admitted = sched.admit()
            staged = set()  # admitted streams whose prefill rides the next step
            if admitted:
                staged = await self._prefill(admitted, stage=inflight is not None and sched.num_running > len(admitted))
            self._drop_cancelled()
            moves = sched.compact() if not staged else []  # a staged slot keeps its place until the launch
            if moves:
                await self._move(moves)
            running = sched.running()
            launched = None
            if running:
                t0 = time.monotonic()
                try:
                    handle = await loop.run_in_executor(self._talker_pool, self.runner.launch, sched.bucket())
                    rows = [(slot, stream) for slot, stream in running if slot not in handle.sat_out]
                    launched = (handle, rows, t0)
                except Exception:
                    log.exception("decode step failed; failing the running requests")
                    self._fail_rows(running)
            if inflight is not None:
                last_codes = await self._deal(*inflight, last_codes)
            inflight = launched
            await asyncio.sleep(0)  # let the codec loop, voices and submissions run between steps

    async def _deal(self, handle, rows: list, launched: float, last_codes: float) -> float:
        """Wait for a launched step's codes and hand each row's frame to its stream; returns when they came.
        Phase talker_step is the time since the later of its launch and the previous step's codes: the pace
        of frames as the streams see it."""
        try:
            codes, ended = await asyncio.get_running_loop().run_in_executor(self._talker_pool, self.runner.collect,
                                                                           handle)
        except Exception:
            log.exception("decode step failed; failing the running requests")
            self._fail_rows(rows)
            return time.monotonic()
        now = time.monotonic()
        self.observe("talker_step", now - max(launched, last_codes))
        dealt, ended_now = 0, []
        for slot, stream in rows:
            if stream.slot is None or stream.cancelled:  # ended at the previous step, or its client left
                continue
            dealt += 1
            if not ended[slot]:
                stream.codec.pending.append(codes[slot])
                stream.frames += 1
            if ended[slot] or stream.frames >= stream.max_frames:
                ended_now.append(stream)
                stream.codec.finished = True
                stream.mark("last_frame", now)
            if stream.codec.due_since is None and stream.codec.due():
                stream.codec.due_since = now
                if stream.codec.decoded_frames == 0:
                    self.observe("first_frames", now - stream.marks["prefilled"])
                    stream.mark("first_due", now)
        self._release(ended_now)
        self._frames_total += dealt
        self._recent_frames.append((now, dealt))
        while now - self._recent_frames[0][0] > RECENT_FRAMES_S:
            self._recent_frames.popleft()
        self._wake_codec.set()
        return now

    def _fail_rows(self, rows: list) -> None:
        for _, stream in rows:
            if stream.slot is not None:
                self._fail(stream, RequestFailed("generation failed"))

    async def _move(self, moves: list[tuple[int, int]]) -> None:
        """Move requests to the lower slots the scheduler gave them (Scheduler.compact). The steps in flight
        remember each row's stream and its slot at launch, so their codes still reach it; a failed move fails
        the moved requests, whose state is then unknown."""
        moved = dict(self.scheduler.running())
        for _, dst in moves:
            moved[dst].slot = dst
        try:
            await asyncio.get_running_loop().run_in_executor(self._talker_pool, self.runner.move, moves)
        except Exception:
            log.exception("moving %d requests between KV slots failed; failing them", len(moves))
            for _, dst in moves:
                self._fail(moved[dst], RequestFailed("generation failed"))
            return
        self._slot_moves += len(moves)

    async def _prefill(self, admitted: list, stage: bool) -> set:
        """Prefill the admitted requests in one call to the talker thread, or with `stage` only build their prompts
        (their prefill rides the next launch: TalkerRunner.stage, which prefills a burst at once), then hand each
        its codec stream. Returns the streams staged."""
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        running = self.scheduler.num_running - len(admitted)
        for slot, stream in admitted:
            stream.slot = slot
            self.observe("queue", t0 - stream.marks["submit"])
            stream.mark("admitted", t0)
            stream.batches.update(prefill_batch=len(admitted), running=running)
        items = [(slot, stream.request) for slot, stream in admitted]
        try:
            if stage:  # a burst is prefilled at once instead (TalkerRunner.stage)
                results, stage = await loop.run_in_executor(self._talker_pool, self.runner.stage, items)
            else:
                results = await loop.run_in_executor(self._talker_pool, self.runner.prefill_many, items)
        except Exception as exc:
            log.exception("prefill failed for %d requests", len(admitted))
            results = [RequestFailed(f"generation failed: {type(exc).__name__}")] * len(admitted)
        done = time.monotonic()
        self.observe("prefill", done - t0)
        staged = set()
        for (slot, stream), result in zip(admitted, results):
            if isinstance(result, Exception):  # the prompt does not fit, or bad reference audio
                self._fail(stream, result if isinstance(result, RequestFailed) else RequestFailed(str(result), 400))
                continue
            context, stream.max_frames = result
            stream.mark("prefilled", done)
            stream.codec = CodecStream(
                first_chunk_frames=stream.request.first_chunk_frames or self.config.first_chunk_frames,
                chunk_frames=self.config.chunk_frames,
                prime_codes=context[len(context) - min(self.config.left_context_frames, len(context)):])
            self._codec_streams.append(stream)
            if stage:
                staged.add(stream)
        return staged

    def _drop_cancelled(self) -> None:
        cancelled = [stream for _, stream in self.scheduler.running() if stream.cancelled]
        self._release(cancelled)
        for stream in cancelled:
            if stream.codec is not None:
                stream.codec.finished = True
                stream.codec.pending.clear()

    def _release(self, streams: list[RequestStream]) -> None:
        """Free the KV slots of streams the talker is done with, in one call to the runner (a step at 128 streams
        of short text ends ~4 requests)."""
        slots = [stream.slot for stream in streams if stream.slot is not None]
        for stream in streams:
            if stream.slot is not None:
                self.scheduler.release(stream.slot)
                stream.slot = None
        self.runner.release(*slots)

    def _fail(self, stream: RequestStream, error: Exception) -> None:
        self._release([stream])
        if stream in self._codec_streams:
            self._codec_streams.remove(stream)
            self.codec.release(stream.codec)
        stream.put(error)

    # --- stage 1: codec ----------------------------------------------------------------------------------
    async def _codec_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            self._codec_streams = [s for s in self._codec_streams if not self._retire(s)]
            for stream in self._codec_streams:  # slots in arrival order, as first chunks come due
                if stream.codec.slot is None and stream.codec.due() and not self.codec.assign(stream.codec):
                    break
            ready = [s for s in self._codec_streams if s.codec.ready() and not s.cancelled]
            t0 = time.monotonic()
            batch, retry_at = next_batch(ready, self.config.max_codec_batch, lambda s: s.codec, t0,
                                         self.config.codec_batch_wait_ms / 1000,
                                         others=len(self._codec_streams) - len(ready))
            if not batch:
                self._wake_codec.clear()
                try:  # new frames (every talker step) or the time the waiting chunks must go
                    await asyncio.wait_for(self._wake_codec.wait(), None if retry_at is None else retry_at - t0)
                except asyncio.TimeoutError:
                    pass
                continue
            for s in batch:
                self.observe("codec_wait", t0 - s.codec.due_since)
                if s.codec.decoded_frames == 0:
                    s.mark("first_codec_start", t0)
                    s.batches["first_codec_batch"] = len(batch)
            chunks = [s.codec.take_chunk() for s in batch]
            for s in batch:  # frames that came in meanwhile may already make the next chunk due
                s.codec.due_since = t0 if s.codec.due() else None
                if s.codec.done:
                    s.mark("last_codec_start", t0)
            try:
                wavs = await loop.run_in_executor(self._codec_pool, self.codec.decode, chunks)
                self.observe("codec_call", time.monotonic() - t0)
            except Exception:
                log.exception("codec decode failed")
                for stream in batch:
                    self._fail(stream, RequestFailed("audio decoding failed"))
                continue
            out_at = time.monotonic()
            for stream, wav in zip(batch, wavs):
                stream.mark("first_codec_end", out_at)
                if stream.codec.done:
                    stream.mark("last_codec_end", out_at)
                stream.codec.delivered(out_at, len(wav) / SAMPLE_RATE)
                if not stream.cancelled:
                    stream.put((wav, out_at))

    def _retire(self, stream: RequestStream) -> bool:
        """A stream leaves the codec stage, and gives back its codec slot, once all its audio is out (or its
        client went away)."""
        if stream.cancelled:
            self.codec.release(stream.codec)
            return True
        if stream.codec.done:
            stream.put(None)
            self._recent_e2e.append(time.monotonic() - stream.marks["submit"])
            self.codec.release(stream.codec)
            return True
        return False
