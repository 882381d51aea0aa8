"""Where a served frame's time goes, stage by stage, in one process on one GPU (no HTTP).

    python benchmarks/stage_timing.py --model DIR [--json OUT.json]

Times, on a random checkpoint (--load-format dummy): the batched prefill of new requests (short and long
texts, 1 to 128 at once); the codec stage's decode call by chunk size and batch; the talker's decode step
alone and while the codec thread decodes at the same time (both stages share the GPU and the Python
interpreter), and the codec call while the talker steps (the talker's stream and graphs at the priority the
stack gives them, TalkerRunner); then both looping at once for a few seconds, as at full load: steps and calls
per second, and their work rate against each one's stand-alone rate. These are the terms of the first-audio
latency (prefill + first_chunk_frames steps + one codec call) and of the served throughput (steps/s vs codec
calls/s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import numpy as np
import torch

SHORT = "Could you repeat that, please?"
LONG = ("The regional transport authority announced on Monday that ticket prices will rise by an average of four "
        "percent from the first of July. Single fares in the city center will go up by twenty cents, while monthly "
        "passes for students and pensioners will stay the same. Officials said the extra money will pay for new "
        "electric buses and longer evening service on the busiest routes.")


def ms(fn, reps: int = 5, device_sync: bool = True) -> float:
    """Median ms of fn(). Beside another thread's GPU work, device_sync=False: a device-wide synchronisation would
    wait for the other stage's kernels too (talker steps and codec calls return once their own stream is done)."""
    times = []
    for _ in range(reps):
        if device_sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device_sync:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--json")
    args = ap.parse_args()

    from serving.engine.codec_stage import CodecChunk
    from serving.engine.engine import EngineConfig
    from serving.engine.loader import load_stages
    from serving.engine.request import GenerationRequest

    config = EngineConfig(model=args.model, load_format="dummy", max_batch_size=128, max_model_len=1024,
                          ignore_eos=True)
    runner, codec, _info = load_stages(config)
    t0 = time.perf_counter()
    runner.warmup()
    codec.warmup((4, 25))
    out: dict = {"warmup_s": round(time.perf_counter() - t0, 1)}

    def release_all():
        for slot in range(runner.num_slots):
            if runner.lengths[slot]:
                runner.release(slot)

    def request(text):
        return GenerationRequest(task="CustomVoice", text=text, speaker="vivian", max_new_tokens=900)

    prefill = {}
    for name, text in (("short", SHORT), ("long", LONG)):
        for n in (1, 8, 32, 128):
            def run():
                release_all()
                runner.prefill_many([(i, request(text)) for i in range(n)])
            prefill[f"{name} x{n}"] = round(ms(run, 3), 1)
    out["prefill_ms"] = prefill
    print("prefill ms:", prefill, flush=True)

    rng = np.random.default_rng(0)
    codes = lambda n: rng.integers(0, 2048, size=(n, 16))  # noqa: E731

    def codec_call_ms(batch: int, frames: int, device_sync: bool = True) -> float:
        """Median of 5 codec calls of `batch` streams x `frames` new frames (the first call starts the streams)."""
        calls = [0]

        def run():
            codec.decode([CodecChunk(slot, codes(frames), calls[0] == 0) for slot in range(batch)])
            calls[0] += 1
        return round(ms(run, 5, device_sync), 1)

    codec_ms = {}
    for batch in (1, 16, 64):
        if batch > codec.num_slots:
            continue
        for frames in (4, 25):
            codec_ms[f"b{batch} x{frames} frames"] = codec_call_ms(batch, frames)
    out["codec_call_ms"] = codec_ms
    print("codec call ms:", codec_ms, flush=True)

    def talker_steps(b: int, stop: threading.Event, done: list | None = None) -> None:
        """Step b rows until told to stop, as the talker thread does (re-prefilled before the slots fill up);
        counts the steps in done[0]."""
        while not stop.is_set():
            if runner.lengths[0] > 900:  # stay inside the KV slot, as the engine's frame limit does
                release_all()
                runner.prefill_many([(i, request(SHORT)) for i in range(b)])
            runner.decode_step(b)
            if done is not None:
                done[0] += 1

    def codec_calls(stop: threading.Event, done: list | None = None) -> None:
        first = True
        while not stop.is_set():
            codec.decode([CodecChunk(s, codes(25), first) for s in range(min(16, codec.num_slots))])
            first = False
            if done is not None:
                done[0] += 1

    def together(b: int, step_alone_ms: float, call_alone_ms: float, seconds: float = 3.0) -> dict:
        """Both stages looping at once, each in its own thread, for `seconds`: steps and b16x25 calls per second,
        and the work rate, steps/s over the step's stand-alone rate plus calls/s over the call's: 1 is as fast as
        running them in turn at their stand-alone times, more is what running them side by side gains."""
        release_all()
        runner.prefill_many([(i, request(SHORT)) for i in range(b)])
        stop, steps, calls = threading.Event(), [0], [0]
        threads = [threading.Thread(target=talker_steps, args=(b, stop, steps)),
                   threading.Thread(target=codec_calls, args=(stop, calls))]
        for t in threads:
            t.start()
        time.sleep(0.5)
        start = (steps[0], calls[0], time.perf_counter())
        time.sleep(seconds)
        end = (steps[0], calls[0], time.perf_counter())
        stop.set()
        for t in threads:
            t.join()
        wall = end[2] - start[2]
        steps_s, calls_s = (end[0] - start[0]) / wall, (end[1] - start[1]) / wall
        return {"steps_per_s": round(steps_s, 1), "calls_per_s": round(calls_s, 1),
                "work_rate": round(steps_s * step_alone_ms / 1e3 + calls_s * call_alone_ms / 1e3, 2)}

    def beside(background, measure):
        """measure() while background(stop) runs in its own thread, as the other stage's thread runs."""
        stop = threading.Event()
        thread = threading.Thread(target=background, args=(stop,))
        thread.start()
        time.sleep(0.5)
        try:
            return measure()
        finally:
            stop.set()
            thread.join()

    # The two stages side by side. A replayed graph's kernels keep the priority of their capture stream, so the
    # talker's priority is the one TalkerRunner captured with (switching runner.stream here would change none).
    cells = {}
    for b in (1, 32, 128):
        release_all()
        runner.prefill_many([(i, request(SHORT)) for i in range(b)])
        cells[f"talker b{b} alone"] = round(ms(lambda: runner.decode_step(b), 20), 2)
        cells[f"talker b{b}, codec b16x25 calls beside"] = beside(
            codec_calls, lambda: round(ms(lambda: runner.decode_step(b), 20, device_sync=False), 2))
        release_all()
        runner.prefill_many([(i, request(SHORT)) for i in range(b)])
        for batch, frames in ((1, 25), (16, 25)):
            cells[f"codec b{batch}x{frames}, talker b{b} stepping beside"] = beside(
                lambda stop: talker_steps(b, stop), lambda: codec_call_ms(batch, frames, device_sync=False))
        cells[f"together: talker b{b} and codec b16x25 looping"] = together(
            b, cells[f"talker b{b} alone"], codec_ms["b16 x25 frames"])
    contended = {"talker priority": runner.priority, **cells}
    print(f"talker priority {runner.priority} (codec's: 0):", cells, flush=True)
    out["contended_ms"] = contended
    out["stream_priority_range"] = list(torch.cuda.Stream.priority_range())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
