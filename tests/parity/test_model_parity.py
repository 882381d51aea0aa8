"""End-to-end parity with the official qwen-tts 0.1.1 on identical random weights.

Tiny checkpoints written by serving.model.checkpoint are loaded by both implementations: the official one in
.venv-ref (tests/parity/reference_run.py, a subprocess) and ours here. CPU, fp32, greedy decoding (which still
applies the repetition penalty, suppression and min_new_tokens, as the official generate does). For every
task and text mode the 64 generated frames must be identical and the waveforms agree to 1e-4.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from serving.model.checkpoint import write_checkpoint
from serving.model.tts import Qwen3TTS

REPO = Path(__file__).resolve().parents[2]
REF_PYTHON = REPO / ".venv-ref" / "bin" / "python"
REF_AUDIO = REPO / "datasets" / "voices" / "en_us_female.wav"
FRAMES = 64
GREEDY = {"do_sample": False, "subtalker_dosample": False, "max_new_tokens": FRAMES + 1}
WAVE_TOL = 1e-4

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

# name -> (checkpoint type, job). Jobs cover the three tasks, both text modes, instructions (kept on 1.7B),
# a dialect speaker (language swap), ICL and x-vector-only cloning.
JOBS = {
    "cv_plain": ("custom_voice", {"task": "custom_voice", "text": "Hello, how are you today?",
                                  "language": "english", "speaker": "vivian"}),
    "cv_instruct": ("custom_voice", {"task": "custom_voice", "text": "今天天气很好，我们一起去公园散步吧。",
                                     "language": "chinese", "speaker": "eric", "instruct": "Speak slowly and warmly."}),
    "cv_streaming_text": ("custom_voice", {"task": "custom_voice", "text": "The quick brown fox jumps.",
                                           "language": "auto", "speaker": "ryan", "non_streaming_mode": False}),
    "vd": ("voice_design", {"task": "voice_design", "text": "Please speak slowly and clearly.",
                            "language": "english", "instruct": "A deep, calm male voice reading the news."}),
    "clone_icl": ("base", {"task": "voice_clone", "text": "Speech synthesis turns text into audio.",
                           "language": "english", "ref_audio": str(REF_AUDIO),
                           "ref_text": "Hello, how are you today? I am fine, thank you."}),
    "clone_xvector": ("base", {"task": "voice_clone", "text": "Guten Tag! Wie geht es Ihnen?",
                               "language": "german", "ref_audio": str(REF_AUDIO), "x_vector_only": True}),
}


def _single_thread_env() -> dict:
    # tiny tensors: thread start-up and spinning dominate, and the machine's 2 cores are shared
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def parity_runs(tmp_path_factory):
    if not REF_PYTHON.exists():
        pytest.fail(f"reference environment missing: run `bash scripts/make_reference_env.sh` ({REF_PYTHON})")
    root = tmp_path_factory.mktemp("parity")
    out_dir = root / "ref"
    out_dir.mkdir()
    checkpoints = {}
    for kind in sorted({kind for kind, _ in JOBS.values()}):
        checkpoints[kind] = write_checkpoint(root / kind, size="tiny", model_type=kind, seed=7)
    procs = []
    for kind, ckpt in checkpoints.items():
        jobs = {name: {**job, "generate": GREEDY} for name, (k, job) in JOBS.items() if k == kind}
        spec = root / f"spec_{kind}.json"
        spec.write_text(json.dumps({"checkpoint": str(ckpt), "jobs": jobs}))
        procs.append((kind, subprocess.Popen([str(REF_PYTHON), str(REPO / "tests/parity/reference_run.py"),
                                               str(spec), str(out_dir)], env=_single_thread_env(),
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
        if len(procs) == 2:  # two cores
            _wait(*procs.pop(0))
    for proc in procs:
        _wait(*proc)
    return checkpoints, out_dir


def _wait(kind: str, proc: subprocess.Popen) -> None:
    out, _ = proc.communicate(timeout=1200)
    assert proc.returncode == 0, f"reference run for {kind} failed:\n{out[-4000:]}"


@pytest.fixture(scope="module")
def models(parity_runs):
    checkpoints, _ = parity_runs
    torch.set_num_threads(1)
    return {kind: Qwen3TTS.load(path, dtype="float32") for kind, path in checkpoints.items()}


def _ours(tts: Qwen3TTS, job: dict, ref: np.lib.npyio.NpzFile):
    kwargs = dict(GREEDY)
    if job.get("non_streaming_mode") is not None:
        kwargs["non_streaming_text"] = job["non_streaming_mode"]
    if job["task"] == "voice_clone":
        audio, sr = sf.read(job["ref_audio"], dtype="float32")
        voice = tts.create_voice_clone_prompt(audio, sr, ref_text=job.get("ref_text"),
                                              x_vector_only=job.get("x_vector_only", False))
        return tts.generate(job["text"], language=job["language"], voice=voice, **kwargs), voice
    out = tts.generate(job["text"], language=job["language"], speaker=job.get("speaker"),
                       instruct=job.get("instruct"), **kwargs)
    return out, None


@pytest.mark.parametrize("name", list(JOBS))
def test_generated_codes_and_waveform_match_official(name, parity_runs, models):
    kind, job = JOBS[name]
    ref = np.load(parity_runs[1] / f"{name}.npz")
    ours, voice = _ours(models[kind], job, ref)
    if voice is not None:
        np.testing.assert_allclose(voice.speaker_embedding.numpy(), ref["spk_embedding"], atol=1e-4, rtol=0,
                                   err_msg="x-vector differs from the official speaker encoder's")
        if "ref_code" in ref:
            np.testing.assert_array_equal(voice.ref_codes.numpy(), ref["ref_code"],
                                          err_msg="reference audio codes differ from the official encoder's")
    assert ref["codes"].shape == (FRAMES, 16), "the official run should produce max_new_tokens - 1 frames"
    assert ours.codes.shape == ref["codes"].shape
    mismatch = np.where((ours.codes.numpy() != ref["codes"]).any(axis=1))[0]
    assert mismatch.size == 0, f"codes differ from frame {mismatch[0]} on ({mismatch.size} frames differ)"
    assert len(set(map(tuple, ref["codes"][:, :2].tolist()))) > FRAMES // 4, "degenerate test: codes barely vary"
    assert int(ref["sample_rate"]) == ours.sample_rate == 24000
    assert ours.audio.shape == ref["wav"].shape
    assert float(np.abs(ref["wav"]).std()) > 0.01, "degenerate test: silent reference waveform"
    err = float(np.abs(ours.audio - ref["wav"]).max())
    assert err <= WAVE_TOL, f"waveform max abs error {err:.2e} > {WAVE_TOL}"
