"""Where a served frame's time goes, stage by stage, in one process on one GPU (no HTTP).

    python benchmarks/stage_timing.py --model DIR [--json OUT.json]

Times, on a random checkpoint (--load-format dummy): the batched prefill of new requests (short and long
texts, 1 to 128 at once); the codec stage's decode call by chunk size and batch; the talker's decode step
alone and while the codec thread decodes at the same time (both stages share the GPU and the Python
interpreter), and the codec call while the talker steps. These are the terms of the first-audio latency
(prefill + first_chunk_frames steps + one codec call) and of the served throughput (steps/s vs codec calls/s).
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


def ms(fn, reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
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

    def codec_call_ms(batch: int, frames: int) -> float:
        """Median of 5 codec calls of `batch` streams x `frames` new frames (the first call starts the streams)."""
        calls = [0]

        def run():
            codec.decode([CodecChunk(slot, codes(frames), calls[0] == 0) for slot in range(batch)])
            calls[0] += 1
        return round(ms(run, 5), 1)

    codec_ms = {}
    for batch in (1, 16, 64):
        if batch > codec.num_slots:
            continue
        for frames in (4, 25):
            codec_ms[f"b{batch} x{frames} frames"] = codec_call_ms(batch, frames)
    out["codec_call_ms"] = codec_ms
    print("codec call ms:", codec_ms, flush=True)

    step_ms = {}
    for b in (1, 32, 128):
        release_all()
        runner.prefill_many([(i, request(SHORT)) for i in range(b)])
        step_ms[f"b{b} alone"] = round(ms(lambda: runner.decode_step(b), 20), 2)
        stop = threading.Event()

        def codec_loop():
            first = True
            while not stop.is_set():
                codec.decode([CodecChunk(s, codes(25), first) for s in range(min(16, codec.num_slots))])
                first = False
        thread = threading.Thread(target=codec_loop)
        thread.start()
        time.sleep(0.5)
        step_ms[f"b{b} with codec b16x25 running"] = round(ms(lambda: runner.decode_step(b), 20), 2)
        stop.set()
        thread.join()
    out["talker_step_ms"] = step_ms
    print("talker step ms:", step_ms, flush=True)

    release_all()
    runner.prefill_many([(0, request(SHORT))])
    stop = threading.Event()

    def talker_loop():
        while not stop.is_set():
            if runner.lengths[0] > 900:  # stay inside the KV slot, as the engine's frame limit does
                release_all()
                runner.prefill_many([(0, request(SHORT))])
            runner.decode_step(1)
    thread = threading.Thread(target=talker_loop)
    thread.start()
    time.sleep(0.5)
    contended = {}
    for batch, frames in ((1, 4), (1, 25), (16, 25)):
        contended[f"b{batch} x{frames} frames, talker stepping"] = codec_call_ms(batch, frames)
    stop.set()
    thread.join()
    out["codec_call_ms_contended"] = contended
    print("codec call ms with the talker stepping:", contended, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
