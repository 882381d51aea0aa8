"""What the engine is asked to generate, and the per-request sampling parameters.

The HTTP layer resolves everything that needs I/O (uploaded voices, data URIs, URLs) before building a
GenerationRequest, so the engine sees only text, arrays and numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

TASKS = ("CustomVoice", "VoiceDesign", "Base")


@dataclass(frozen=True)
class SamplingParams:
    """Talker (code 0) and sub-talker (codes 1-15) sampling; the defaults are generation_config.json's."""

    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    do_sample: bool = True
    subtalker_temperature: float = 0.9
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0
    subtalker_do_sample: bool = True
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
