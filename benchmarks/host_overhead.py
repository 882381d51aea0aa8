"""Host time the engine spends per decode step, with both stages' device work stubbed out.

    python benchmarks/host_overhead.py [--concurrency 1,32,128] [--frames 250] [--step-ms 0,9] [--json OUT]

A served step is as fast as the GPU only while the engine's Python keeps up: the talker loop (admission, the
executor hops of launch and collect, dealing each row's codes to its stream), the codec loop (choosing the rows of
each call, cutting chunks, queueing the waveforms) share the engine's event loop, and the streams' consumers read
on the caller's, all in one interpreter. This runs the real Engine (scheduler, both loops, their executor threads)
with stage stubs: a decode step's codes are zeros for its rows, ready `--step-ms` after the later of its launch and
the previous step's end, as steps queue on a GPU (0: at once; a sleep otherwise, which frees the interpreter as a
GPU wait does); a codec call returns zero samples for its chunks after `--codec-ms`. Closed-loop clients at each
concurrency read the audio in-process (no HTTP). Reported per level: steps per second, ms per step, the engine
process's CPU time per step (all threads), mean rows per step and per codec call, the share of the frames a GPU's
codec graphs would compute that is padding (StubCodec), audio seconds per second (12.5 frames per audio second),
and that against the ideal of every stream busy at steps of exactly --step-ms (c x 80 ms of audio per step); and
the lag in handing a chunk to its reader on the caller's loop (phase `deliver`). At --step-ms 0 the steps per
second are the host's ceiling.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from dataclasses import dataclass
from unittest import mock

import numpy as np

from serving.engine.codec_graphs import cover, make_batch_buckets, make_frame_buckets
from serving.engine.codec_stage import call_frames, padding_shares
from serving.engine.engine import Engine, EngineConfig, EngineInfo
from serving.engine.request import GenerationRequest
from serving.engine.scheduler import make_buckets
from serving.model.config import GenerationDefaults

GROUPS = 16  # codes per frame
SAMPLES_PER_FRAME = 1920  # 24 kHz / 12.5 Hz


@dataclass
class StubStep:
    """A launched step (TalkerRunner's StepHandle): every staged request rides it and draws its first frame."""

    bucket: int
    ready_at: float  # when its codes are there
    sat_out: tuple[int, ...] = ()


class StubTalker:
    """TalkerRunner's interface to the engine; each step's codes are ready step_s after its launch."""

    warmup_s: dict = {}

    def __init__(self, num_slots: int, step_s: float, frames: int):
        self.num_slots, self.buckets = num_slots, make_buckets(num_slots)
        self.step_s, self.frames = step_s, frames
        self.steps = 0
        self._ready_at = 0.0  # when the last launched step is done

    def warmup(self) -> None:
        pass

    def describe(self) -> dict:
        return {}

    def needs_voice(self, request) -> bool:
        return False  # custom-voice requests: no reference audio to encode

    def prefill_many(self, items: list) -> list:
        return [(np.zeros((0, GROUPS), dtype=np.int64), self.frames) for _ in items]

    def stage(self, items: list) -> tuple[list, bool]:
        return self.prefill_many(items), True  # a prefill that rides the next launch costs the stub nothing

    def release(self, *slots: int) -> None:
        pass

    def move(self, moves: list) -> None:
        pass  # a move only queues copies on the talker's stream

    def launch(self, bucket: int) -> StubStep:
        """As on a GPU, a step starts once the one before it is done (two may be outstanding)."""
        self.steps += 1
        self._ready_at = max(time.monotonic(), self._ready_at) + self.step_s
        return StubStep(bucket, self._ready_at)

    def collect(self, handle: StubStep) -> tuple[np.ndarray, np.ndarray]:
        wait = handle.ready_at - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        return np.zeros((handle.bucket, GROUPS), dtype=np.int64), np.zeros(handle.bucket, dtype=bool)


class StubCodec:
    """CodecRunner's interface to the engine; a call returns silence for its chunks after call_s. It counts the
    frames a GPU would compute for each call as CodecRunner does: the cheapest of the default graph shapes
    (codec_graphs' batch and frames buckets) that covers the call's rows and its longest chunk."""

    graph_report = None

    def __init__(self, num_slots: int, call_s: float, buckets: list[tuple[int, int]]):
        self._free = list(range(num_slots))
        self.call_s = call_s
        self.buckets = buckets
        self.calls = self.chunks = 0
        self.frames_decoded = self.frames_computed = self.frames_padding_rows = 0

    def warmup(self, frame_counts, prime_frames: int = 0) -> None:
        pass

    def describe(self) -> dict:
        return {}

    def assign(self, stream) -> bool:
        if stream.slot is None and self._free:
            stream.slot = self._free.pop()
        return stream.slot is not None

    def release(self, stream) -> None:
        if stream.slot is not None:
            self._free.append(stream.slot)
            stream.slot = None

    def decode(self, chunks: list) -> list[np.ndarray]:
        self.calls += 1
        self.chunks += len(chunks)
        lengths = [len(c.codes) for c in chunks]
        decoded, computed, padding_rows = call_frames(lengths, cover(self.buckets, len(chunks), max(lengths)))
        self.frames_decoded += decoded
        self.frames_computed += computed
        self.frames_padding_rows += padding_rows
        if self.call_s:
            time.sleep(self.call_s)
        return [np.zeros(len(c.codes) * SAMPLES_PER_FRAME, dtype=np.float32) for c in chunks]


def _info(config: EngineConfig, slots: int) -> EngineInfo:
    return EngineInfo(model_name="stub", model_path="stub", task_type="CustomVoice", speakers=("vivian",),
                      languages=("auto",), speaker_embedding_dim=None, supports_instructions=False,
                      chunk_frames=config.chunk_frames, num_slots=slots, generation=GenerationDefaults())


async def run_level(concurrency: int, requests: int, frames: int, step_ms: float, codec_ms: float) -> dict:
    """One closed-loop level on a fresh engine: `requests` requests of `frames` frames each."""
    config = EngineConfig(model="stub", max_batch_size=concurrency, max_queue=requests)
    buckets = [(b, f) for b in make_batch_buckets(config.max_codec_batch)
               for f in make_frame_buckets(config.first_chunk_frames, config.chunk_frames)]
    talker, codec = StubTalker(concurrency, step_ms / 1000, frames), StubCodec(concurrency, codec_ms / 1000, buckets)
    engine = Engine(config)
    with mock.patch("serving.engine.loader.load_stages", lambda cfg: (talker, codec, _info(cfg, concurrency))):
        await engine.start()
    deliver: list[float] = []
    engine.observe = lambda phase, seconds: deliver.append(seconds) if phase == "deliver" else None
    todo = list(range(requests))
    samples = 0

    async def client() -> None:
        nonlocal samples
        while todo:
            todo.pop()
            stream = await engine.submit(GenerationRequest(task="CustomVoice", text="stub", speaker="vivian",
                                                     max_new_tokens=frames))
            async for chunk in stream:
                samples += len(chunk)

    cpu0, t0, steps0 = time.process_time(), time.monotonic(), talker.steps
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    await engine.shutdown()
    steps = talker.steps - steps0
    audio_s = samples / (SAMPLES_PER_FRAME * 12.5)
    rows = requests * frames / steps
    row = {"concurrency": concurrency, "requests": requests, "frames": frames, "step_ms": step_ms,
           "codec_ms": codec_ms, "wall_s": round(wall, 3), "steps": steps,
           "steps_per_s": round(steps / wall, 1), "ms_per_step": round(1000 * wall / steps, 3),
           "cpu_ms_per_step": round(1000 * cpu / steps, 3), "rows_per_step": round(rows, 1),
           "codec_calls": codec.calls, "codec_chunks": codec.chunks,
           "rows_per_codec_call": round(codec.chunks / max(codec.calls, 1), 1),
           "codec_frames_decoded": codec.frames_decoded, "codec_frames_computed": codec.frames_computed,
           **{f"codec_{k}": v for k, v in padding_shares(codec.frames_decoded, max(codec.frames_computed, 1),
                                                          codec.frames_padding_rows).items()},
           "audio_s": round(audio_s, 3), "audio_s_per_s": round(audio_s / wall, 1),
           "deliver_ms_p50": round(1000 * float(np.percentile(deliver, 50)), 3) if deliver else None,
           "deliver_ms_p95": round(1000 * float(np.percentile(deliver, 95)), 3) if deliver else None}
    if step_ms:  # what a step of exactly step_ms would give with every row busy
        row["of_ideal"] = round(row["audio_s_per_s"] / (concurrency * 0.08 / (step_ms / 1000)), 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,32,128", help="comma-separated levels")
    ap.add_argument("--frames", type=int, default=250, help="frames per request (20 s of audio: 250)")
    ap.add_argument("--requests-per-stream", type=int, default=4)
    ap.add_argument("--step-ms", default="0", help="comma-separated decode step times to emulate (0: none)")
    ap.add_argument("--codec-ms", type=float, default=0.0, help="time of each codec call to emulate")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    if args.frames < 1 or args.requests_per_stream < 1 or args.codec_ms < 0:
        ap.error("--frames and --requests-per-stream must be at least 1, --codec-ms at least 0")
    levels = [int(c) for c in args.concurrency.split(",")]
    step_times = [float(s) for s in args.step_ms.split(",")]
    if min(levels) < 1 or min(step_times) < 0:
        ap.error("levels must be at least 1 and step times at least 0")
    print(f"# {platform.processor() or platform.machine()}, python {platform.python_version()}; "
          f"{args.frames} frames per request, codec call {args.codec_ms} ms")
    header = ("c", "step_ms", "steps/s", "ms/step", "cpu ms/step", "rows/step", "rows/codec call", "codec padding",
              "audio s/s", "of ideal", "deliver p50/p95 ms")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    rows = []
    for step_ms in step_times:
        for c in levels:
            r = asyncio.run(run_level(c, c * args.requests_per_stream, args.frames, step_ms, args.codec_ms))
            rows.append(r)
            print(f"| {c} | {step_ms:g} | {r['steps_per_s']} | {r['ms_per_step']} | {r['cpu_ms_per_step']} | "
                  f"{r['rows_per_step']} | {r['rows_per_codec_call']} | {r['codec_padded_share']:.1%} "
                  f"({r['codec_rows_share']:.1%} rows) | "
                  f"{r['audio_s_per_s']} | "
                  f"{r.get('of_ideal', '-')} | {r['deliver_ms_p50']} / {r['deliver_ms_p95']} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
