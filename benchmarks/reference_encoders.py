"""A voice clone's reference encoders on a GPU: the speaker encoder and the codec encoder at a clip length met for
the first time, then repeated, with cuDNN on and off (alternating, a new length each time). Each reference has its
own length and is encoded once per voice, so the first call is what a new voice costs (serving/engine/prompts.py).

    python benchmarks/reference_encoders.py CKPT      (CKPT: a Base checkpoint, e.g. serving.model.checkpoint --type base)
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from serving.engine.engine import EngineConfig
from serving.engine.loader import load_stages
from serving.model.config import SAMPLE_RATE

SECONDS = (3.13, 3.71, 4.29, 5.93, 6.37, 7.11)  # one new length per (repeat, mode)


def ms(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    runner, _codec, _info = load_stages(EngineConfig(model=sys.argv[1], load_format="dummy", max_batch_size=8,
                                                     max_model_len=1024))
    speaker, codec = runner.prompts.model.speaker_encoder, runner.prompts.codec_encoder
    rng = np.random.default_rng(0)

    def clip(seconds: float) -> np.ndarray:
        return (rng.standard_normal(int(SAMPLE_RATE * seconds)) * 0.1).astype(np.float32)

    warm = clip(3.0)  # the process's first calls, apart
    for _ in range(2):
        speaker.embed(warm, SAMPLE_RATE), codec.encode([warm], SAMPLE_RATE)
    lengths = iter(SECONDS)
    for _ in range(len(SECONDS) // 2):
        for mode in ("cudnn", "no-cudnn"):
            audio = clip(next(lengths))
            with torch.backends.cudnn.flags(enabled=mode == "cudnn"):
                first_s, again_s = (ms(lambda: speaker.embed(audio, SAMPLE_RATE)) for _ in range(2))
                first_c, again_c = (ms(lambda: codec.encode([audio], SAMPLE_RATE)) for _ in range(2))
            print(f"{mode:9s} clip {len(audio) / SAMPLE_RATE:.2f}s  speaker first {first_s:7.1f} repeat {again_s:6.1f} ms"
                  f"   codec encoder first {first_c:7.1f} repeat {again_c:6.1f} ms", flush=True)


if __name__ == "__main__":
    main()
