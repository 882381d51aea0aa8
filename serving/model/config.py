"""Configuration of a Qwen3-TTS 12Hz checkpoint, read from its official config.json and generation_config.json.

Missing keys fall back to the official package's constructor defaults (qwen-tts 0.1.1), so any file the
official loader accepts means the same thing here. Two traps are handled explicitly: `head_dim` comes from
the file (hidden/heads is wrong for 0.6B), and the code predictor gets a `small_to_mtp_projection` exactly
when its hidden size differs from the talker's (1.7B).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SAMPLE_RATE = 24000  # Hz of the 12 Hz model's audio, in (references) and out (the codec's waveforms)
TASK_BY_MODEL_TYPE = {"custom_voice": "custom_voice", "voice_design": "voice_design", "base": "voice_clone"}


class ConfigError(ValueError):
    """A checkpoint's config file is missing, unreadable or inconsistent."""


def read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path} not found: not a Qwen3-TTS checkpoint directory?") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None


@dataclass(frozen=True)
class TransformerConfig:
    """One decoder-only transformer stack (talker or code predictor)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    hidden_act: str = "silu"
    attention_bias: bool = False

    def __post_init__(self):
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported (Qwen3-TTS uses silu)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )


def _transformer(raw: dict, defaults: dict, where: str) -> TransformerConfig:
    merged = {**defaults, **{k: v for k, v in raw.items() if v is not None}}
    if "head_dim" not in raw:  # the official getattr fallback; real checkpoints always carry head_dim
        merged["head_dim"] = merged["hidden_size"] // merged["num_attention_heads"]
    try:
        return TransformerConfig(**{k: merged[k] for k in TransformerConfig.__dataclass_fields__ if k in merged})
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


# Constructor defaults of the official configuration classes (configuration_qwen3_tts.py).
_TALKER_DEFAULTS = dict(
    vocab_size=3072, hidden_size=1024, intermediate_size=2048, num_hidden_layers=20, num_attention_heads=16,
    num_key_value_heads=2, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
    rope_theta=10000.0, attention_bias=False,
)
_CODE_PREDICTOR_DEFAULTS = dict(
    vocab_size=2048, hidden_size=1024, intermediate_size=3072, num_hidden_layers=5, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
    rope_theta=10000.0, attention_bias=False,
)


@dataclass(frozen=True)
class TalkerConfig:
    transformer: TransformerConfig
    code_predictor: TransformerConfig
    text_vocab_size: int
    text_hidden_size: int
    num_code_groups: int
    codec_eos_token_id: int
    codec_think_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    codec_pad_id: int
    codec_bos_id: int
    spk_id: dict[str, int]
    spk_is_dialect: dict[str, str | bool]
    codec_language_id: dict[str, int]

    @property
    def has_mtp_projection(self) -> bool:
        """1.7B: the code predictor is narrower than the talker and projects its inputs down."""
        return self.code_predictor.hidden_size != self.transformer.hidden_size

    @property
    def suppressed_code0_ids(self) -> range:
        """The top 1024 talker ids are control/speaker/language tags, never sampled (eos excepted)."""
        return range(self.transformer.vocab_size - 1024, self.transformer.vocab_size)


@dataclass(frozen=True)
class ModelConfig:
    talker: TalkerConfig
    speaker_encoder: dict  # raw speaker_encoder_config; speaker_encoder.py reads it
    tts_model_type: str  # "base" | "custom_voice" | "voice_design"
    tts_model_size: str  # "0b6" | "1b7"
    tokenizer_type: str
    im_start_token_id: int
    im_end_token_id: int
    tts_pad_token_id: int
    tts_bos_token_id: int
    tts_eos_token_id: int
    raw: dict = field(repr=False, compare=False, default_factory=dict)

    @property
    def task(self) -> str:
        return TASK_BY_MODEL_TYPE[self.tts_model_type]

    @property
    def speakers(self) -> list[str]:
        return sorted(self.talker.spk_id)

    @property
    def languages(self) -> list[str]:
        """Selectable languages as the official wrapper lists them: "auto" plus every non-dialect entry."""
        return ["auto"] + [k for k in self.talker.codec_language_id if "dialect" not in k]

    @property
    def drops_instruct(self) -> bool:
        """The official CustomVoice wrapper ignores instructions on 0.6B (`tts_model_size in "0b6"`)."""
        return self.tts_model_type == "custom_voice" and self.tts_model_size in "0b6"

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        if raw.get("model_type") != "qwen3_tts":
            raise ConfigError(f"config.json model_type is {raw.get('model_type')!r}, expected 'qwen3_tts'")
        tts_model_type = raw.get("tts_model_type")
        if tts_model_type not in TASK_BY_MODEL_TYPE:
            raise ConfigError(
                f"config.json tts_model_type is {tts_model_type!r}, expected one of {sorted(TASK_BY_MODEL_TYPE)}"
            )
        if raw.get("tokenizer_type", "qwen3_tts_tokenizer_12hz") != "qwen3_tts_tokenizer_12hz":
            raise ConfigError(f"tokenizer_type {raw.get('tokenizer_type')!r}: only the 12Hz speech tokenizer is supported")
        t = raw.get("talker_config") or {}
        for where, sub in (("talker_config", t), ("code_predictor_config", t.get("code_predictor_config") or {})):
            if sub.get("use_sliding_window"):
                raise ConfigError(f"{where}.use_sliding_window is set: sliding-window attention is not implemented")
            rope_type = (sub.get("rope_scaling") or {}).get("rope_type", (sub.get("rope_scaling") or {}).get("type"))
            if rope_type not in (None, "default"):
                raise ConfigError(f"{where}.rope_scaling type {rope_type!r} is not supported (only default RoPE)")
        if "text_vocab_size" not in t:
            raise ConfigError("config.json talker_config has no text_vocab_size")
        talker = TalkerConfig(
            transformer=_transformer(t, _TALKER_DEFAULTS, "talker_config"),
            code_predictor=_transformer(t.get("code_predictor_config") or {}, _CODE_PREDICTOR_DEFAULTS,
                                        "talker_config.code_predictor_config"),
            text_vocab_size=t["text_vocab_size"],
            text_hidden_size=t.get("text_hidden_size", 2048),
            num_code_groups=t.get("num_code_groups", 32),
            codec_eos_token_id=t.get("codec_eos_token_id", 4198),
            codec_think_id=t.get("codec_think_id", 4202),
            codec_nothink_id=t.get("codec_nothink_id", 4203),
            codec_think_bos_id=t.get("codec_think_bos_id", 4204),
            codec_think_eos_id=t.get("codec_think_eos_id", 4205),
            codec_pad_id=t.get("codec_pad_id", 4196),
            codec_bos_id=t.get("codec_bos_id", 4197),
            spk_id={k.lower(): v for k, v in (t.get("spk_id") or {}).items()},
            spk_is_dialect={k.lower(): v for k, v in (t.get("spk_is_dialect") or {}).items()},
            codec_language_id={k.lower(): v for k, v in (t.get("codec_language_id") or {}).items()},
        )
        cp = talker.code_predictor
        if cp.vocab_size > talker.transformer.vocab_size:
            raise ConfigError("code predictor vocab_size exceeds the talker's codec vocab_size")
        if talker.num_code_groups < 2:
            raise ConfigError(f"num_code_groups {talker.num_code_groups} < 2")
        for name, dialect in talker.spk_is_dialect.items():
            if dialect and dialect not in talker.codec_language_id:
                raise ConfigError(f"speaker {name!r} dialect {dialect!r} has no codec_language_id entry")
        return cls(
            talker=talker,
            speaker_encoder=raw.get("speaker_encoder_config") or {},
            tts_model_type=tts_model_type,
            tts_model_size=raw.get("tts_model_size") or "",
            tokenizer_type=raw.get("tokenizer_type", "qwen3_tts_tokenizer_12hz"),
            im_start_token_id=raw.get("im_start_token_id", 151644),
            im_end_token_id=raw.get("im_end_token_id", 151645),
            tts_pad_token_id=raw.get("tts_pad_token_id", 151671),
            tts_bos_token_id=raw.get("tts_bos_token_id", 151672),
            tts_eos_token_id=raw.get("tts_eos_token_id", 151673),
            raw=raw,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        return cls.from_dict(read_json(Path(path) / "config.json"))


@dataclass(frozen=True)
class GenerationDefaults:
    """generation_config.json as the official wrapper reads it: a plain dict, hard defaults for absent keys."""

    do_sample: bool = True
    top_k: int = 50
    top_p: float = 1.0
    temperature: float = 0.9
    repetition_penalty: float = 1.05
    subtalker_dosample: bool = True
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0
    subtalker_temperature: float = 0.9
    max_new_tokens: int = 2048

    @classmethod
    def from_dir(cls, path: str | Path) -> "GenerationDefaults":
        p = Path(path) / "generation_config.json"
        if not p.exists():
            return cls()
        raw = read_json(p)
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})
