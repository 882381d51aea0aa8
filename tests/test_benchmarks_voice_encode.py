"""benchmarks/voice_encode_bench.py times each built-in voice's encoding by part; on CPU with the tiny encoders
it must still run end to end and its parts must add up to each total."""

import json
import sys

import numpy as np
import pytest
import torch

from benchmarks import voice_encode_bench


def test_every_clip_is_timed_by_part(tmp_path, monkeypatch, capsys):
    out = tmp_path / "voices.json"
    monkeypatch.setattr(sys, "argv", ["voice_encode_bench.py", "--device", "cpu", "--size", "tiny", "--reps", "1",
                                      "--json", str(out)])
    voice_encode_bench.main()
    result = json.loads(out.read_text())
    clips = sorted(p.name for p in voice_encode_bench.VOICES.glob("*.wav"))
    assert [r["clip"] for r in result["rows"]] == clips and len(clips) == 8
    for row in result["rows"]:
        assert 3 < row["seconds"] < 6
        for call in (row["first"], row["repeat"]):
            parts = call["resample"] + call["mel"] + call["speaker_net"] + call["codec"]
            assert call["codec"] > 0 and call["speaker_net"] > 0 and parts == pytest.approx(call["total"], abs=0.05)
    assert "mean over 8 clips" in capsys.readouterr().out


@pytest.mark.slow
def test_parallel_encoders_are_timed_as_threads_and_as_processes(tmp_path, monkeypatch, capsys):
    """--parallel: every figure is a rate of voices that were all encoded, by threads of this process and by spawned
    processes each with its own encoders (the same random weights: build() is seeded)."""
    out = tmp_path / "voices.json"
    monkeypatch.setattr(sys, "argv", ["voice_encode_bench.py", "--device", "cpu", "--size", "tiny", "--reps", "1",
                                      "--parallel", "1,2", "--parallel-voices", "4", "--json", str(out)])
    voice_encode_bench.main()
    parallel = json.loads(out.read_text())["parallel"]
    assert [p["workers"] for p in parallel] == [1, 2]
    assert all(p["threads"] > 0 and p["processes"] > 0 for p in parallel)
    assert "| 2 | " in capsys.readouterr().out


def test_a_worker_builds_the_encoders_of_this_process():
    """A worker process's start (run here) builds the same encoders (seeded weights), so what it encodes is what this
    process encodes; it turns cuDNN off, as served (restored here)."""
    clip = np.random.default_rng(0).standard_normal(24000).astype(np.float32) * 0.1
    speaker, codec = voice_encode_bench.build("tiny", torch.device("cpu"))
    with torch.inference_mode():
        here = voice_encode_bench.encode_voice(speaker, codec, clip)
    found = torch.backends.cudnn.enabled
    try:
        voice_encode_bench._worker_start("tiny", "cpu", clip)
        assert torch.backends.cudnn.enabled is False
        with torch.inference_mode():
            there = voice_encode_bench.encode_voice(*voice_encode_bench._worker["encoders"], clip)
    finally:
        voice_encode_bench._worker.clear()
        torch.backends.cudnn.enabled = found
    assert torch.equal(here[1], there[1]) and torch.allclose(here[0], there[0])
