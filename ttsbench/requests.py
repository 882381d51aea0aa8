"""Request bodies for /v1/audio/speech, one builder per task (vllm-omni-compatible fields).

Bodies are serialised here, before the clock starts, so the client's timed section only sends bytes.
"""

from __future__ import annotations

import base64
import io
import json
import secrets
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ttsbench import datasets

TASK_TYPES = {"custom": "CustomVoice", "design": "VoiceDesign", "clone": "Base"}
TASKS = tuple(TASK_TYPES)
RESPONSE_FORMATS = ("pcm", "wav", "flac")
STREAM_FORMATS = ("audio", "sse")
CLONE_MODES = ("inline", "upload", "fresh")
FRESH_BITS = 64  # fresh clone mode: samples whose lowest bit carries a request's number


@dataclass(frozen=True)
class RequestOptions:
    """What the user chose for every request of a run (see `ttsbench run --help`)."""
    model: str | None = None
    voice: str | None = None
    language: str | None = None
    instructions: str = "off"
    response_format: str | None = None
    stream: bool = True
    stream_format: str = "audio"
    max_new_tokens: int | None = None
    sampling_seed: int | None = None
    clone_mode: str = "inline"

    def format(self) -> str:
        """Raw PCM streams cheapest; WAV is the API default for whole responses."""
        return self.response_format or ("pcm" if self.stream else "wav")


@dataclass(frozen=True)
class SpeechRequest:
    """One request ready to send, plus what the record needs to say about it."""
    item: datasets.Item
    body: bytes
    voice: str | None
    instructions: str | None
    ref_audio_path: str | None
    ref_text: str | None


def _display_path(path: Path) -> str:
    """Relative to the datasets folder when it lies inside it, as run-format.md asks."""
    try:
        return str(path.resolve().relative_to(datasets.datasets_dir().resolve()))
    except ValueError:
        return str(path.resolve())


class RequestBuilder:
    """Builds the n-th request of a task: speakers, instructions, designs and voices go round-robin
    over the request index, so a level's requests spread evenly over them."""

    def __init__(self, task: str, options: RequestOptions):
        if task not in TASK_TYPES:
            raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
        self.task = task
        self.options = options
        self._speakers: list[str] = []
        self._instructions: list[str | None] = [None]
        self._voices: list[datasets.Voice] = []
        self._data_uris: dict[str, bytes] = {}
        self._clip_paths: dict[str, str] = {}  # each voice's clip as records show it (two path resolutions)
        self._fresh_next = secrets.randbits(32) << 32  # fresh clone mode: numbers no other run of this one uses
        if task == "custom":
            self._setup_custom()
        elif task == "design":
            self._setup_design()
        else:
            self._setup_clone()

    def _setup_custom(self) -> None:
        opts = self.options
        if opts.voice:
            self._speakers = [opts.voice]
        else:
            self._speakers = [s.name for s in datasets.load_speakers()]
        if opts.instructions == "on":
            self._instructions = [p.text for p in datasets.load_instructions()]
        elif opts.instructions != "off":
            self._instructions = [opts.instructions]

    def _setup_design(self) -> None:
        opts = self.options
        if opts.instructions in ("on", "off"):
            self._instructions = [p.text for p in datasets.load_designs()]
        else:
            self._instructions = [opts.instructions]

    def _setup_clone(self) -> None:
        voices = datasets.load_voices()
        if self.options.voice:
            voices = [v for v in voices if v.name == self.options.voice]
            if not voices:
                names = ", ".join(v.name for v in datasets.load_voices())
                raise datasets.DatasetError(
                    f"unknown reference voice {self.options.voice!r}; available: {names}")
        self._voices = voices
        self._clip_paths = {v.name: _display_path(v.path) for v in voices}

    @property
    def voices(self) -> list[datasets.Voice]:
        """Reference voices this builder uses (clone), e.g. to upload them first."""
        return self._voices

    def _data_uri(self, voice: datasets.Voice) -> bytes:
        """The voice's clip as a data: URI, ASCII (what a JSON body carries of it as it is)."""
        uri = self._data_uris.get(voice.name)
        if uri is None:
            uri = b"data:audio/wav;base64," + base64.b64encode(voice.path.read_bytes())
            self._data_uris[voice.name] = uri
        return uri

    def _fresh_uri(self, voice: datasets.Voice) -> bytes:
        """The voice's clip with the lowest bit of its first FRESH_BITS samples set to a number no other request of
        any run gets: the same sound (one step of 16 bits, -90 dB), a voice new to a server that caches voices by
        their audio, as a cloning API meets one whenever a user brings their own."""
        number, self._fresh_next = self._fresh_next, self._fresh_next + 1
        try:
            with wave.open(str(voice.path), "rb") as src:
                params, frames = src.getparams(), src.readframes(src.getnframes())
        except (wave.Error, EOFError) as exc:
            raise datasets.DatasetError(f"--clone-mode fresh reads 16-bit PCM WAV clips; {voice.path}: {exc}") from None
        if params.sampwidth != 2 or params.nframes * params.nchannels < FRESH_BITS:
            raise datasets.DatasetError(f"--clone-mode fresh reads 16-bit PCM WAV clips of at least {FRESH_BITS} "
                                        f"samples; {voice.path} is not one")
        samples = np.frombuffer(frames, "<i2").copy()
        bits = (number >> np.arange(FRESH_BITS, dtype=np.uint64)) & 1
        samples[:FRESH_BITS] = (samples[:FRESH_BITS] & ~1) | bits.astype(np.int16)
        out = io.BytesIO()
        with wave.open(out, "wb") as dst:
            dst.setparams(params)
            dst.writeframes(samples.tobytes())
        return b"data:audio/wav;base64," + base64.b64encode(out.getvalue())

    def build(self, item: datasets.Item, index: int) -> SpeechRequest:
        opts = self.options
        body: dict = {"input": item.text}
        if opts.model:
            body["model"] = opts.model
        body["task_type"] = TASK_TYPES[self.task]
        body["language"] = opts.language or item.language
        voice = instructions = ref_audio_path = ref_text = clip_uri = None
        if self.task == "custom":
            voice = self._speakers[index % len(self._speakers)]
            body["voice"] = voice
        if self.task in ("custom", "design"):
            instructions = self._instructions[index % len(self._instructions)]
            if instructions is not None:
                body["instructions"] = instructions
        if self.task == "clone":
            ref = self._voices[index % len(self._voices)]
            voice, ref_text, ref_audio_path = ref.name, ref.ref_text, self._clip_paths[ref.name]
            if opts.clone_mode == "upload":
                body["voice"] = ref.name
            else:
                clip_uri = self._fresh_uri(ref) if opts.clone_mode == "fresh" else self._data_uri(ref)
                body["ref_text"] = ref.ref_text
        body["response_format"] = opts.format()
        body["stream"] = opts.stream
        if opts.stream:
            body["stream_format"] = opts.stream_format
        if opts.max_new_tokens is not None:
            body["max_new_tokens"] = opts.max_new_tokens
        if opts.sampling_seed is not None:
            body["seed"] = opts.sampling_seed
        encoded = json.dumps(body, ensure_ascii=False).encode("utf-8")
        if clip_uri is not None:
            # The clip joins the serialised body as it is: a data: URI of base64 has nothing JSON escapes. Through
            # json.dumps a clone body cost the client's event loop ~0.9 ms (2-core VM, request_build_bench.py), ~120
            # ms for the bodies of a first wave of 128 clones, which went out that much less at once.
            encoded = b"".join((encoded[:-1], b', "ref_audio": "', clip_uri, b'"}'))
        return SpeechRequest(item=item, body=encoded, voice=voice, instructions=instructions,
                             ref_audio_path=ref_audio_path, ref_text=ref_text)
