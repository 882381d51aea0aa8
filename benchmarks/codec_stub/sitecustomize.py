"""The talker's ceiling (benchmarks/gpu_bench.sh CODEC_STUB=1): on PYTHONPATH with CODEC_STUB=1 in the environment,
the codec of any server this interpreter starts returns silence of each chunk's length without touching the GPU,
so a served level runs at the pace of everything else (admissions, prefills, decode steps, the host, HTTP): the
throughput a free codec would give, and by difference what the codec costs (docs/performance.md twenty-ninth pass).
A diagnostic, never the product: the patch goes on when serving.engine.codec_stage is imported."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

MODULE = "serving.engine.codec_stage"


def silent_decode(self, chunks):
    """CodecRunner.decode without the decoder: one silent float32 waveform per chunk, its frames counted as
    decoded and computed (no padding), so /metrics and the engine's phases stay whole."""
    import numpy as np

    lengths = [len(chunk.codes) for chunk in chunks]
    self.frames_decoded += sum(lengths)
    self.frames_computed += sum(lengths)
    return [np.zeros(n * self.samples_per_frame, dtype=np.float32) for n in lengths]


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            module.CodecRunner.decode = silent_decode
            print("CODEC_STUB: the codec returns silence without decoding", file=sys.stderr, flush=True)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("CODEC_STUB") == "1":
    sys.meta_path.insert(0, _PatchOnImport())
