"""Uploaded voices on disk: one folder per voice under --voices-dir, written atomically.

A voice is a reference clip (stored as the decoded 24 kHz mono WAV, with the transcript for in-context
cloning) or a bare speaker embedding. Each is written to a temporary folder that is renamed into place,
so a crash never leaves half a voice, and the store is simply re-read at start-up.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

from serving.api.audio import SAMPLE_RATE

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
MAX_VOICES = 1000


class VoiceError(ValueError):
    """A voice that cannot be stored; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass(frozen=True)
class Voice:
    name: str
    meta: dict
    audio: np.ndarray | None  # 24 kHz mono float32 (clip voices)
    embedding: np.ndarray | None  # speaker embedding (embedding voices)

    @property
    def ref_text(self) -> str | None:
        return self.meta.get("ref_text")

    @property
    def key(self) -> str:
        """Changes when a voice of the same name is re-created, so caches keyed on it stay right."""
        return f"{self.name}@{self.meta['created_at']}"


def normalize_name(name: str) -> str:
    """Voice names are case-insensitive and must be safe as a folder name (no path tricks)."""
    norm = name.strip().lower()
    if not NAME_RE.match(norm) or ".." in norm:
        raise VoiceError("voice name must be 1-64 characters of letters, digits, '_', '-' or '.', "
                         "starting with a letter or digit", param="name")
    return norm


class VoiceStore:
    def __init__(self, root: Path, reserved: tuple[str, ...] = ()):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.reserved = {r.lower() for r in reserved}
        self._cache: dict[str, Voice] = {}
        for stale in self.root.glob(".tmp-*"):  # left by a crash mid-write
            shutil.rmtree(stale, ignore_errors=True)

    def names(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and (p / "meta.json").is_file())

    def list(self) -> list[dict]:
        return [self._read_meta(name) for name in self.names()]

    def get(self, name: str) -> Voice | None:
        try:
            norm = normalize_name(name)
        except VoiceError:
            return None
        folder = self.root / norm
        if not (folder / "meta.json").is_file():
            self._cache.pop(norm, None)
            return None
        meta = self._read_meta(norm)
        cached = self._cache.get(norm)
        if cached is not None and cached.meta == meta:
            return cached
        audio = embedding = None
        if meta["kind"] == "audio":
            audio, _ = sf.read(folder / "audio.wav", dtype="float32")
        else:
            embedding = np.load(folder / "embedding.npy")
        voice = Voice(norm, meta, audio, embedding)
        self._cache[norm] = voice
        return voice

    def add_audio(self, name: str, samples: np.ndarray, *, source_bytes: int, mime_type: str,
                  ref_text: str | None, consent: str) -> dict:
        meta = {"kind": "audio", "file_size": source_bytes, "mime_type": mime_type,
                "duration_s": round(len(samples) / SAMPLE_RATE, 3), "sample_rate": SAMPLE_RATE}
        return self._write(name, meta, ref_text, consent,
                           lambda d: sf.write(d / "audio.wav", samples, SAMPLE_RATE, subtype="PCM_16"))

    def add_embedding(self, name: str, embedding: np.ndarray, *, ref_text: str | None, consent: str) -> dict:
        meta = {"kind": "embedding", "file_size": int(embedding.nbytes), "mime_type": "application/x-npy",
                "embedding_dim": int(embedding.shape[0])}
        return self._write(name, meta, ref_text, consent,
                           lambda d: np.save(d / "embedding.npy", embedding.astype(np.float32)))

    def delete(self, name: str) -> bool:
        norm = normalize_name(name)
        folder = self.root / norm
        if not (folder / "meta.json").is_file():
            return False
        trash = Path(tempfile.mkdtemp(prefix=".tmp-del-", dir=self.root))
        folder.rename(trash / norm)  # atomic: the voice disappears at once, then the files go
        shutil.rmtree(trash, ignore_errors=True)
        self._cache.pop(norm, None)
        return True

    def _write(self, name: str, meta: dict, ref_text: str | None, consent: str, write_payload) -> dict:
        norm = normalize_name(name)
        if norm in self.reserved:
            raise VoiceError(f"{norm!r} is a built-in speaker; choose another name", param="name")
        if (self.root / norm).exists():
            raise VoiceError(f"voice {norm!r} already exists; delete it first", status=409, param="name")
        if len(self.names()) >= MAX_VOICES:
            raise VoiceError(f"the store holds the maximum of {MAX_VOICES} voices; delete some first")
        meta = {"name": norm, "created_at": int(time.time()), **meta, "ref_text": ref_text, "consent": consent}
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.root))
        try:
            write_payload(tmp)
            (tmp / "meta.json").write_text(json.dumps(meta, ensure_ascii=False, indent=1))
            tmp.rename(self.root / norm)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if (self.root / norm).exists():
                raise VoiceError(f"voice {norm!r} already exists; delete it first", status=409,
                                 param="name") from None
            raise VoiceError(f"could not store the voice: {exc}", status=500) from None
        return meta

    def _read_meta(self, norm: str) -> dict:
        return json.loads((self.root / norm / "meta.json").read_text())
