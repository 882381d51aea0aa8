"""benchmarks/codec_stub (gpu_bench.sh CODEC_STUB=1): an interpreter started with it on PYTHONPATH and CODEC_STUB=1
serves silence of each request's length, its frames counted as decoded; without CODEC_STUB=1 it changes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = textwrap.dedent("""
    import asyncio
    import numpy as np
    from serving.engine.checkpoint import resolve_model
    from serving.engine.engine import Engine, EngineConfig
    from serving.engine.request import GenerationRequest, SamplingParams

    async def main():
        engine = Engine(EngineConfig(model=str(resolve_model("tiny-random")), max_batch_size=2, max_model_len=128,
                                     chunk_frames=4, first_chunk_frames=2))
        await engine.start()
        try:
            request = GenerationRequest(task="CustomVoice", text="Hello there.", speaker="vivian", max_new_tokens=7,
                                        sampling=SamplingParams(seed=1))
            audio = np.concatenate([c async for c in await engine.submit(request)])
            return audio, engine.codec.frames_decoded, engine.codec.frames_computed
        finally:
            await engine.shutdown()

    audio, decoded, computed = asyncio.run(main())
    print(len(audio), float(np.abs(audio).max()), decoded, computed)
""")


def _run(stub: str) -> tuple[list[str], str]:
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'benchmarks' / 'codec_stub'}{os.pathsep}{REPO}", CODEC_STUB=stub)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split(), proc.stderr


def test_the_stub_serves_silence_of_each_requests_length_and_counts_its_frames():
    (samples, peak, decoded, computed), stderr = _run("1")
    assert "CODEC_STUB: the codec returns silence" in stderr
    assert int(samples) == 7 * 1920 and float(peak) == 0.0
    assert int(decoded) == int(computed) == 7  # warm-up's calls are not counted (CodecRunner.warmup resets)


def test_without_the_switch_the_codec_decodes():
    (samples, peak, _decoded, _computed), stderr = _run("")
    assert "CODEC_STUB" not in stderr
    assert int(samples) == 7 * 1920 and float(peak) > 0.0
