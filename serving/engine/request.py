"""What the engine is asked to generate, and the per-request sampling parameters.

The HTTP layer resolves everything that needs I/O (uploaded voices, data URIs, URLs) before building a
GenerationRequest, so the engine sees only text, arrays and numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from serving.model.config import GenerationDefaults

TASKS = ("CustomVoice", "VoiceDesign", "Base")


_OFFICIAL = GenerationDefaults()  # generation_config.json's values when a checkpoint omits them


@dataclass(frozen=True)
class SamplingParams:
    """Talker (code 0) and sub-talker (codes 1-15) sampling. The server fills every field from the request and
    the loaded checkpoint's generation_config.json; these defaults serve direct users of the engine."""

    temperature: float = _OFFICIAL.temperature
    top_k: int = _OFFICIAL.top_k
    top_p: float = _OFFICIAL.top_p
    repetition_penalty: float = _OFFICIAL.repetition_penalty
    do_sample: bool = _OFFICIAL.do_sample
    subtalker_temperature: float = _OFFICIAL.subtalker_temperature
    subtalker_top_k: int = _OFFICIAL.subtalker_top_k
    subtalker_top_p: float = _OFFICIAL.subtalker_top_p
    subtalker_do_sample: bool = _OFFICIAL.subtalker_dosample
    seed: int = 0  # the same seed gives the same codes, alone or inside any batch


@dataclass
class GenerationRequest:
    task: str  # one of TASKS
    text: str
    language: str = "auto"  # lower case
    speaker: str | None = None  # CustomVoice built-in speaker, lower case
    instructions: str | None = None
    ref_audio: np.ndarray | None = None  # Base: 24 kHz mono float32 reference clip
    ref_text: str | None = None  # Base: transcript of ref_audio (in-context cloning)
    speaker_embedding: np.ndarray | None = None  # Base: x-vector given directly
    x_vector_only: bool = False  # Base: condition on the x-vector alone (no reference codes)
    voice_key: str | None = None  # uploaded voice identity, lets the engine cache its embedding and codes
    # ref_audio's x-vector and codes (CPU tensors), once the engine's voice thread has encoded them (new voices)
    encoded_voice: tuple | None = None
    non_streaming_mode: bool | None = None  # None: the task's default (text streamed in for Base only)
    max_new_tokens: int = 2048
    first_chunk_frames: int | None = None  # None: the engine's --first-chunk-frames
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
