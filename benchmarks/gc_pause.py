"""How long a full Python garbage collection stalls a warmed engine, before and after gc.freeze().

    python benchmarks/gc_pause.py --model DIR

Loading, torch.compile and graph capture leave about a million long-lived Python objects; every full
collection scans them all, holding the GIL, so every thread of the server (talker, codec, HTTP) stops for
it. Engine.start freezes them after warmup; this measures what that removes.
"""

from __future__ import annotations

import argparse
import gc
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    args = ap.parse_args()

    from serving.engine.checkpoint import resolve_model
    from serving.engine.engine import EngineConfig
    from serving.engine.loader import load_stages

    config = EngineConfig(model=str(resolve_model(args.model)), load_format="dummy", max_batch_size=128,
                          max_model_len=1024, ignore_eos=True)
    runner, codec, _info = load_stages(config)
    runner.warmup()
    codec.warmup((config.first_chunk_frames, config.chunk_frames))
    print("tracked objects", len(gc.get_objects()), "thresholds", gc.get_threshold())
    for label in ("", "", "", "after gc.freeze: ", "after gc.freeze: "):
        if label and not gc.get_freeze_count():
            gc.freeze()
        t0 = time.perf_counter()
        gc.collect()
        print(f"{label}full collection {(time.perf_counter() - t0) * 1e3:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
