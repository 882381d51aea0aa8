"""Speaker-embedding backends for speaker similarity (cosine of embeddings of 16 kHz audio).

- `ecapa`: speechbrain's ECAPA-TDNN trained on VoxCeleb (spkrec-ecapa-voxceleb, EER 0.8%), the usual
  speaker-verification model, loaded from a local directory only (never the hub): `--sim-model DIR`, or
  <models>/spkrec-ecapa-voxceleb/. Its hyperparams.yaml points `pretrained_path` at the hub, so we
  override it with the directory.
- `resemblyzer`: the GE2E d-vector encoder whose weights ship inside the resemblyzer package, so it runs
  anywhere. Coarser than ECAPA (different espeak voices still score 0.6-0.8), so compare its figures
  only with figures of the same backend.
- `auto` (the default): ecapa where its weights are in place (then speechbrain must import), else
  resemblyzer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ttsbench.quality import weights
from ttsbench.quality.device import resolve as device_resolve
from ttsbench.quality.audio import MODEL_RATE
from ttsbench.quality.errors import QualityError

BACKENDS = ("auto", "ecapa", "resemblyzer")
ECAPA_DIRNAME = "spkrec-ecapa-voxceleb"
_ECAPA_FILES = "hyperparams.yaml, embedding_model.ckpt, mean_var_norm_emb.ckpt, classifier.ckpt, label_encoder.txt"
_RESEMBLYZER_INSTALL = "pip install librosa scipy webrtcvad-wheels && pip install --no-deps resemblyzer"


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


class ResemblyzerEmbedder:
    backend = "resemblyzer"

    def __init__(self, device: str = "auto"):
        try:
            from resemblyzer import VoiceEncoder, preprocess_wav
        except ImportError as exc:
            raise QualityError(f"the resemblyzer backend needs resemblyzer ({exc}): {_RESEMBLYZER_INSTALL} "
                               "(--no-deps: its webrtcvad dependency does not build here; webrtcvad-wheels "
                               "provides the same module)") from exc
        self._preprocess = preprocess_wav
        self._encoder = VoiceEncoder(device=device_resolve(device), verbose=False)

    def embed(self, audio_16k: np.ndarray) -> np.ndarray | None:
        """The utterance embedding, or None when no speech is left after trimming silence."""
        if not np.any(np.abs(audio_16k) > 1e-4):
            return None  # digital silence: resemblyzer's volume normalization would divide by zero
        wav = self._preprocess(audio_16k.astype(np.float32), source_sr=MODEL_RATE)
        if len(wav) < MODEL_RATE // 4:
            return None
        return np.asarray(self._encoder.embed_utterance(wav), dtype=np.float32)


def ecapa_dir(sim_model: Path | None, models_dir: Path | None) -> Path:
    return Path(sim_model).expanduser() if sim_model else weights.models_dir(models_dir) / ECAPA_DIRNAME


class EcapaEmbedder:
    backend = "ecapa"

    def __init__(self, source: Path, device: str = "auto"):
        if not (source / "hyperparams.yaml").is_file():
            raise QualityError(f"no ECAPA weights in {source}: copy the files of speechbrain/spkrec-ecapa-voxceleb "
                               f"({_ECAPA_FILES}) there, or pass --sim-model DIR, or use --sim resemblyzer")
        try:
            from speechbrain.inference.speaker import EncoderClassifier
            from speechbrain.utils.fetching import LocalStrategy
        except Exception as exc:  # ImportError, or torchaudio failing to load against this torch
            raise QualityError(f"the ecapa backend needs speechbrain and a torchaudio that matches your torch "
                               f"({type(exc).__name__}: {exc}): pip install speechbrain torchaudio; "
                               "or use --sim resemblyzer") from exc
        import torch

        self._torch = torch
        # NO_LINK: read the files where they are (no copies or symlinks written beside them).
        self._model = EncoderClassifier.from_hparams(
            source=str(source), savedir=str(source), local_strategy=LocalStrategy.NO_LINK,
            run_opts={"device": device_resolve(device)}, overrides={"pretrained_path": str(source)})

    def embed(self, audio_16k: np.ndarray) -> np.ndarray | None:
        if len(audio_16k) < MODEL_RATE // 4:
            return None
        with self._torch.no_grad():
            emb = self._model.encode_batch(self._torch.from_numpy(audio_16k.astype(np.float32))[None])
        return emb.reshape(-1).cpu().numpy().astype(np.float32)


def load_embedder(backend: str, sim_model: Path | None = None, device: str = "auto",
                  models_dir: Path | None = None):
    """A speaker-embedding backend by name; raises QualityError naming what to install or where to put files."""
    if backend == "auto":
        source = ecapa_dir(sim_model, models_dir)
        if (source / "hyperparams.yaml").is_file():
            return EcapaEmbedder(source, device)
        return ResemblyzerEmbedder(device)
    if backend == "ecapa":
        return EcapaEmbedder(ecapa_dir(sim_model, models_dir), device)
    if backend == "resemblyzer":
        return ResemblyzerEmbedder(device)
    raise QualityError(f"unknown speaker backend {backend!r} (choose from {', '.join(BACKENDS)} or none)")
