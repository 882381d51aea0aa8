"""The real models, offline: whisper base (openai-whisper and faster-whisper, from the PyPI weights) and
resemblyzer, on espeak-ng speech; and the errors users get when a backend or its weights are missing."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from tests.quality_support import SENTENCES, espeak
from ttsbench.quality import normalize, weights
from ttsbench.quality.asr import load_asr
from ttsbench.quality.audio import read_clip
from ttsbench.quality.errors import QualityError
from ttsbench.quality.speaker import cosine, load_embedder

BASE_DIMS = {"n_mels": 80, "n_audio_ctx": 1500, "n_audio_state": 512, "n_audio_head": 8, "n_audio_layer": 6,
             "n_vocab": 51865, "n_text_ctx": 448, "n_text_state": 512, "n_text_head": 8, "n_text_layer": 6}


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, np.ndarray]:
    """16 kHz audio: the sentences by one espeak voice, one by another voice, and broken audio."""
    d = tmp_path_factory.mktemp("speech")
    out = {f"s{i}": read_clip(espeak(d / f"s{i}.wav", text, "en-us")).at() for i, text in enumerate(SENTENCES)}
    out["other_voice"] = read_clip(espeak(d / "f.wav", SENTENCES[1], "en+f3")).at()
    speech = out["s2"]
    rng = np.random.default_rng(0)
    pieces = speech[: len(speech) // 800 * 800].reshape(-1, 800)           # 50 ms pieces, shuffled
    out["scrambled"] = pieces[rng.permutation(len(pieces))].reshape(-1)
    out["silent"] = np.zeros(3 * 16000, dtype=np.float32)
    return out


@pytest.fixture(scope="module")
def whisper_texts(clips) -> dict[str, str]:
    asr = load_asr("whisper", "base", device="cpu")
    return {name: asr.transcribe(clips[name], "English") for name in ("s0", "s1", "s2", "scrambled", "silent")}


def test_whisper_base_transcribes_espeak_speech(whisper_texts):
    wers = [normalize.score(text, whisper_texts[f"s{i}"]).wer for i, text in enumerate(SENTENCES)]
    assert np.mean(wers) < 0.3, list(zip(SENTENCES, wers, [whisper_texts[f"s{i}"] for i in range(3)]))


def test_scrambled_and_silent_audio_score_high_wer(whisper_texts):
    for name in ("scrambled", "silent"):
        wer = normalize.score(SENTENCES[2], whisper_texts[name]).wer
        assert wer >= 0.8, (name, whisper_texts[name], wer)


def test_faster_whisper_matches_whisper(clips, whisper_texts):
    """The same weights through CTranslate2: identical transcripts also check the checkpoint conversion."""
    asr = load_asr("faster-whisper", "base", device="cpu")
    assert asr.transcribe(clips["s0"], "English") == whisper_texts["s0"]


def test_assembled_weights(tmp_path):
    root = weights.models_dir()
    ct2_dir, checkpoint = weights.assemble_whisper_base(root)   # already there: returns at once
    variables = weights.read_ct2_whisper(ct2_dir / "model.bin")
    assert variables["decoder/projection/weight"] is variables["decoder/embeddings/weight"]  # an alias
    import torch

    ckpt = torch.load(checkpoint, map_location="cpu")
    assert ckpt["dims"] == BASE_DIMS
    assert ckpt["model_state_dict"]["encoder.blocks.0.attn.query.weight"].shape == (512, 512)
    assert "encoder.blocks.0.attn.key.bias" not in ckpt["model_state_dict"]    # whisper's key has no bias
    (tmp_path / "bad.bin").write_bytes(b"\x06\x00\x00\x00\x0c\x00WhisperSpec\x00\x03\x00")
    with pytest.raises(QualityError, match="not a complete CTranslate2 model"):
        weights.read_ct2_whisper(tmp_path / "bad.bin")


def test_resemblyzer_same_voice_is_closer_than_another_voice(clips):
    embedder = load_embedder("resemblyzer", device="cpu")
    same = cosine(embedder.embed(clips["s0"]), embedder.embed(clips["s1"]))
    other = cosine(embedder.embed(clips["s0"]), embedder.embed(clips["other_voice"]))
    assert same > other + 0.05, (same, other)
    assert embedder.embed(clips["silent"]) is None       # nothing left once silence is trimmed


def test_auto_picks_resemblyzer_without_ecapa_weights(tmp_path):
    assert load_embedder("auto", models_dir=tmp_path).backend == "resemblyzer"


def test_ecapa_errors_name_what_to_provide(tmp_path):
    with pytest.raises(QualityError, match="no ECAPA weights in .*spkrec-ecapa-voxceleb.*--sim-model DIR"):
        load_embedder("ecapa", models_dir=tmp_path)
    (tmp_path / "hyperparams.yaml").write_text("pretrained_path: speechbrain/spkrec-ecapa-voxceleb\n")
    # speechbrain cannot import here (its torchaudio needs CUDA torch): the error says what to install
    with pytest.raises(QualityError, match="needs speechbrain and a torchaudio .*pip install speechbrain"):
        load_embedder("ecapa", sim_model=tmp_path)


def test_missing_packages_name_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "whisper", None)        # as if openai-whisper were not installed
    with pytest.raises(QualityError, match="pip install --no-deps openai-whisper"):
        load_asr("whisper", "base")
    monkeypatch.setitem(sys.modules, "faster_whisper", None)
    with pytest.raises(QualityError, match="pip install --no-deps faster-whisper"):
        load_asr("faster-whisper", "base")
    monkeypatch.setitem(sys.modules, "resemblyzer", None)
    with pytest.raises(QualityError, match="pip install --no-deps resemblyzer"):
        load_embedder("resemblyzer")


def test_missing_weights_name_where_to_put_them(tmp_path):
    with pytest.raises(QualityError, match="no whisper checkpoint at .*nowhere.pt"):
        load_asr("whisper", str(tmp_path / "nowhere.pt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(QualityError, match="cannot load faster-whisper model .*faster-whisper-"):
        load_asr("faster-whisper", str(tmp_path / "empty"), device="cpu", models_dir=tmp_path)
