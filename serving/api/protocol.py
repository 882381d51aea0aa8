"""The /v1/audio/speech request: vllm-omni's fields plus the sampling parameters of the Qwen3-TTS RFC.

Validation happens here, before anything reaches the engine, so every bad field gets a 400 that names it.
What a field may hold depends on the loaded checkpoint (its task, speakers, languages, embedding size):
`Capabilities` carries that, so this module needs no model code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from serving.api.errors import APIError, bad_request
from serving.model.config import GenerationDefaults

TASK_TYPES = ("CustomVoice", "VoiceDesign", "Base")
RESPONSE_FORMATS = ("wav", "pcm", "flac", "mp3", "opus")
STREAM_FORMATS = ("audio", "sse")
# Streaming sends audio as it is decoded: only formats whose bytes can be cut anywhere.
STREAMABLE_FORMATS = ("wav", "pcm")
MAX_INPUT_CHARS = 4096
MAX_INSTRUCTIONS_CHARS = 500
MAX_REF_TEXT_CHARS = 2000
MAX_NEW_TOKENS = 4096
DEFAULT_MAX_NEW_TOKENS = 2048
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class Capabilities:
    """What the served checkpoint can do; the server fills it from the model's config."""

    model_names: tuple[str, ...]  # values accepted in the `model` field (first = the id /v1/models lists)
    task_type: str  # one of TASK_TYPES
    speakers: tuple[str, ...] = ()  # built-in speakers, lower case (CustomVoice)
    languages: tuple[str, ...] = ("auto",)  # lower case, "auto" included
    speaker_embedding_dim: int | None = None  # x-vector size (Base)
    supports_instructions: bool = False
    max_chunk_frames: int = 25
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)  # generation_config.json: sampling defaults


@dataclass
class SpeechRequest:
    """A validated request. Sampling defaults are the served checkpoint's generation_config.json
    (Capabilities.generation); the rest follow vllm-omni."""

    input: str
    task_type: str
    model: str | None = None
    voice: str | None = None  # built-in speaker (CustomVoice) or uploaded voice name (Base), lower case
    instructions: str | None = None
    language: str = "auto"
    ref_audio: str | None = None  # data: URI, http(s) URL or uploaded voice name; resolved by the server
    ref_text: str | None = None
    x_vector_only_mode: bool = False
    speaker_embedding: list[float] | None = None
    response_format: str = "wav"
    speed: float = 1.0
    stream: bool = False
    stream_format: str = "audio"
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    seed: int | None = None
    initial_codec_chunk_frames: int | None = None
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    do_sample: bool = True
    non_streaming_mode: bool | None = None  # None: the task's default (text streamed in for Base)
    subtalker_temperature: float = 0.9
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0
    subtalker_do_sample: bool = True


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class _Fields:
    """Typed reads from the JSON body; each failure is a 400 naming the field."""

    def __init__(self, body: dict[str, Any]):
        self.body = body

    def present(self, name: str) -> bool:
        return self.body.get(name) is not None

    def string(self, name: str, *, max_len: int | None = None) -> str | None:
        v = self.body.get(name)
        if v is None:
            return None
        if not isinstance(v, str):
            raise bad_request(f"'{name}' must be a string", name, "invalid_type")
        if max_len is not None and len(v) > max_len:
            raise bad_request(f"'{name}' is too long ({len(v)} characters, at most {max_len})", name)
        return v

    def boolean(self, name: str, default: bool | None) -> bool | None:
        v = self.body.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise bad_request(f"'{name}' must be true or false", name, "invalid_type")
        return v

    def integer(self, name: str, default: int | None, lo: int, hi: int) -> int | None:
        v = self.body.get(name)
        if v is None:
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not _is_int(v):
            raise bad_request(f"'{name}' must be an integer", name, "invalid_type")
        if not lo <= v <= hi:
            raise bad_request(f"'{name}' must be between {lo} and {hi}, got {v}", name)
        return v

    def number(self, name: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
        v = self.body.get(name)
        if v is None:
            return default
        if not _is_number(v) or v != v:  # rejects bools and NaN
            raise bad_request(f"'{name}' must be a number", name, "invalid_type")
        if v > hi or v < lo or (lo_open and v == lo):
            low = f"greater than {lo}" if lo_open else f"at least {lo}"
            raise bad_request(f"'{name}' must be {low} and at most {hi}, got {v}", name)
        return float(v)

    def choice(self, name: str, default: str, choices: tuple[str, ...], *, case_insensitive: bool = True) -> str:
        v = self.string(name)
        if v is None:
            return default
        lookup = {c.lower(): c for c in choices} if case_insensitive else {c: c for c in choices}
        key = v.lower() if case_insensitive else v
        if key not in lookup:
            raise bad_request(f"'{name}' must be one of {', '.join(choices)}; got {v!r}", name)
        return lookup[key]


def parse_speech_request(body: Any, caps: Capabilities, max_chunk_frames: int | None = None) -> SpeechRequest:
    """Validate a decoded JSON body against the schema and the checkpoint. Raises APIError."""
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", None, "invalid_json")
    f = _Fields(body)

    text = f.string("input", max_len=MAX_INPUT_CHARS)
    if text is None:
        raise bad_request("'input' is required", "input", "missing_required_parameter")
    if not text.strip():
        raise bad_request("'input' must not be empty", "input")

    model = f.string("model")
    if model and model not in caps.model_names:
        raise APIError(404, f"model {model!r} is not served here; this server serves {caps.model_names[0]!r}",
                       param="model", code="model_not_found")

    task_type = f.choice("task_type", caps.task_type, TASK_TYPES)
    if task_type != caps.task_type:
        raise bad_request(f"task_type {task_type!r} is not supported by the loaded checkpoint, "
                          f"which does {caps.task_type}", "task_type", "unsupported_task")

    voice = f.string("voice")
    speaker = f.string("speaker")
    if voice is not None and speaker is not None and voice.lower() != speaker.lower():
        raise bad_request("'voice' and 'speaker' name different voices; give one", "voice")
    voice = (voice if voice is not None else speaker)
    voice = voice.strip().lower() if voice is not None and voice.strip() else None

    instructions = f.string("instructions", max_len=MAX_INSTRUCTIONS_CHARS)
    if instructions is not None and not instructions.strip():
        instructions = None

    language = f.string("language")
    if language is None or not language.strip():
        language = "auto"
    language = language.strip().lower()
    if language not in caps.languages:
        raise bad_request(f"unknown language {language!r}; supported: "
                          f"{', '.join(sorted(caps.languages))}", "language", "unsupported_language")

    ref_audio = f.string("ref_audio")
    ref_text = f.string("ref_text", max_len=MAX_REF_TEXT_CHARS)
    if ref_text is not None and not ref_text.strip():
        ref_text = None
    x_vector_only = f.boolean("x_vector_only_mode", False)
    embedding = parse_speaker_embedding(body.get("speaker_embedding"), caps)

    response_format = f.choice("response_format", "wav", RESPONSE_FORMATS)
    stream = f.boolean("stream", False)
    stream_format = f.choice("stream_format", "audio", STREAM_FORMATS)
    if stream and response_format not in STREAMABLE_FORMATS:
        raise bad_request(f"streaming supports response_format {' or '.join(STREAMABLE_FORMATS)}, "
                          f"not {response_format!r}", "response_format")

    g = caps.generation
    req = SpeechRequest(
        input=text,
        task_type=task_type,
        model=model,
        voice=voice,
        instructions=instructions,
        language=language,
        ref_audio=ref_audio,
        ref_text=ref_text,
        x_vector_only_mode=x_vector_only,
        speaker_embedding=embedding,
        response_format=response_format,
        speed=f.number("speed", 1.0, 0.25, 4.0),
        stream=stream,
        stream_format=stream_format,
        max_new_tokens=f.integer("max_new_tokens", DEFAULT_MAX_NEW_TOKENS, 1, MAX_NEW_TOKENS),
        seed=f.integer("seed", None, 0, MAX_SEED),
        initial_codec_chunk_frames=f.integer("initial_codec_chunk_frames", None, 1,
                                             max_chunk_frames or caps.max_chunk_frames),
        temperature=f.number("temperature", g.temperature, 0.0, 5.0, lo_open=True),
        top_k=f.integer("top_k", g.top_k, 0, 100_000),
        top_p=f.number("top_p", g.top_p, 0.0, 1.0, lo_open=True),
        repetition_penalty=f.number("repetition_penalty", g.repetition_penalty, 0.0, 10.0, lo_open=True),
        do_sample=f.boolean("do_sample", g.do_sample),
        non_streaming_mode=f.boolean("non_streaming_mode", None),
        subtalker_temperature=f.number("subtalker_temperature", g.subtalker_temperature, 0.0, 5.0, lo_open=True),
        subtalker_top_k=f.integer("subtalker_top_k", g.subtalker_top_k, 0, 100_000),
        subtalker_top_p=f.number("subtalker_top_p", g.subtalker_top_p, 0.0, 1.0, lo_open=True),
        subtalker_do_sample=f.boolean("subtalker_do_sample", g.subtalker_dosample),
    )
    _check_task_fields(req, caps)
    return req


def parse_speaker_embedding(v: Any, caps: Capabilities) -> list[float] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not all(_is_number(x) for x in v):
        raise bad_request("'speaker_embedding' must be a list of numbers", "speaker_embedding", "invalid_type")
    if caps.speaker_embedding_dim is None:
        raise bad_request("'speaker_embedding' needs a voice-clone (Base) checkpoint", "speaker_embedding")
    if len(v) != caps.speaker_embedding_dim:
        raise bad_request(f"'speaker_embedding' must have {caps.speaker_embedding_dim} values, got {len(v)}",
                          "speaker_embedding")
    if not all(abs(x) < 1e6 for x in v):  # also rejects inf and NaN
        raise bad_request("'speaker_embedding' holds non-finite or huge values", "speaker_embedding")
    return [float(x) for x in v]


def _check_task_fields(req: SpeechRequest, caps: Capabilities) -> None:
    """Cross-field rules that depend on the task."""
    if req.task_type == "CustomVoice":
        if req.ref_audio is not None or req.speaker_embedding is not None:
            raise bad_request("ref_audio and speaker_embedding need a voice-clone (Base) checkpoint; "
                              "CustomVoice uses a built-in 'voice'", "ref_audio" if req.ref_audio else
                              "speaker_embedding")
        if req.voice is None:
            req.voice = "vivian" if "vivian" in caps.speakers else (caps.speakers[0] if caps.speakers else None)
        if req.voice not in caps.speakers:
            raise bad_request(f"unknown voice {req.voice!r}; built-in speakers: {', '.join(caps.speakers)}",
                              "voice", "unknown_voice")
        if req.instructions is not None and not caps.supports_instructions:
            raise bad_request("this CustomVoice checkpoint does not follow instructions (0.6B); "
                              "leave 'instructions' out", "instructions")
    elif req.task_type == "VoiceDesign":
        if req.instructions is None:
            raise bad_request("VoiceDesign needs 'instructions' describing the voice", "instructions",
                              "missing_required_parameter")
        if req.ref_audio is not None or req.speaker_embedding is not None:
            raise bad_request("VoiceDesign takes no reference audio or speaker embedding", "ref_audio")
        req.voice = None  # the voice is the description; OpenAI clients must send some voice name
    else:  # Base
        if req.instructions is not None:
            raise bad_request("voice cloning (Base) takes no 'instructions'", "instructions")
        if req.ref_audio is not None and req.speaker_embedding is not None:
            raise bad_request("give either 'ref_audio' or 'speaker_embedding', not both", "speaker_embedding")
        if req.ref_audio is None and req.speaker_embedding is None and req.voice is None:
            raise bad_request("voice cloning needs 'ref_audio' (data: URI, URL or uploaded voice name), an "
                              "uploaded 'voice', or a 'speaker_embedding'", "ref_audio",
                              "missing_required_parameter")
        if req.speaker_embedding is not None:
            req.x_vector_only_mode = True  # an embedding has no reference codes to condition on
