"""benchmarks/voice_encode_bench.py times each built-in voice's encoding by part; on CPU with the tiny encoders
it must still run end to end and its parts must add up to each total."""

import json
import sys
import threading

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


def test_eager_times_the_modules_python_forward_and_says_so(tmp_path, monkeypatch, capsys):
    """--eager: the modules' own forward (the server before TorchScript), named in the output and the JSON; the
    codes are the scripted networks' (the same operators)."""
    out = tmp_path / "voices.json"
    monkeypatch.setattr(sys, "argv", ["voice_encode_bench.py", "--device", "cpu", "--size", "tiny", "--reps", "1",
                                      "--voices", str(_one_voice(tmp_path)), "--eager", "--json", str(out)])
    voice_encode_bench.main()
    assert json.loads(out.read_text())["eager"] is True and "; eager; ms" in capsys.readouterr().out
    clip = np.random.default_rng(1).standard_normal(30000).astype(np.float32) * 0.1
    speaker, codec = voice_encode_bench.build("tiny", torch.device("cpu"))
    eager, script = (voice_encode_bench.encode_voice(speaker, codec, nets, clip)
                     for nets in (voice_encode_bench.scripted(speaker, codec, e) for e in (True, False)))
    assert torch.equal(eager[0], script[0]) and torch.equal(eager[1], script[1])


def _one_voice(tmp_path):
    import shutil

    folder = tmp_path / "one"
    folder.mkdir()
    shutil.copy(voice_encode_bench.VOICES / "fr_female.wav", folder)
    return folder


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
        here = voice_encode_bench.encode_voice(speaker, codec, voice_encode_bench.scripted(speaker, codec, False), clip)
    found = torch.backends.cudnn.enabled
    try:
        voice_encode_bench._worker_start("tiny", "cpu", clip, False)
        assert torch.backends.cudnn.enabled is False
        with torch.inference_mode():
            there = voice_encode_bench.encode_voice(*voice_encode_bench._worker["encoders"], clip)
    finally:
        voice_encode_bench._worker.clear()
        torch.backends.cudnn.enabled = found
    assert torch.equal(here[1], there[1]) and torch.allclose(here[0], there[0])


def test_busy_threads_run_until_the_block_ends():
    before = threading.active_count()
    with voice_encode_bench.busy_threads(2, torch.device("cpu")):
        assert threading.active_count() == before + 2
    assert threading.active_count() == before
