"""Configuration of the 12 Hz speech tokenizer (codec), read from a checkpoint's speech_tokenizer/config.json.

The file nests a Mimi `encoder_config` (reference audio -> codes) and a `decoder_config` (codes -> waveform).
Defaults are those of the official classes (qwen-tts 0.1.1 and transformers' MimiConfig), so a config.json
that leaves a key out means what it means to the official loader. `to_dict` writes the same layout back,
which is how test and dummy checkpoints get their speech_tokenizer/config.json.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

MODEL_TYPE = "qwen3_tts_tokenizer_12hz"


def _pick(cls, raw: dict, where: str) -> dict:
    """Keep the keys `cls` knows (the files carry many more); lists become tuples, with the key named if not a list."""
    out = {}
    for f in fields(cls):
        if f.name not in raw:
            continue
        value = raw[f.name]
        if str(f.type).startswith("tuple"):
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"{where}.{f.name}: expected a list, got {value!r}")
            value = tuple(int(v) for v in value)
        out[f.name] = value
    return out


@dataclass(frozen=True)
class CodecDecoderConfig:
    """Qwen3TTSTokenizerV2DecoderConfig: split RVQ, transformer with a sliding window, SnakeBeta vocoder."""

    codebook_size: int = 2048
    codebook_dim: int = 512  # RVQ output width; each codebook holds codebook_dim // 2 wide vectors
    latent_dim: int = 1024
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int | None = None  # None: hidden_size // num_attention_heads, as the official getattr fallback
    hidden_act: str = "silu"
    attention_bias: bool = False
    max_position_embeddings: int = 8000
    rope_theta: float = 10000.0
    sliding_window: int = 72
    rms_norm_eps: float = 1e-5
    layer_scale_initial_scale: float = 0.01
    num_quantizers: int = 16
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    upsampling_ratios: tuple[int, ...] = (2, 2)
    decoder_dim: int = 1536

    def __post_init__(self):
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.hidden_act != "silu":
            raise ValueError(f"decoder_config.hidden_act: only 'silu' is supported, got {self.hidden_act!r}")
        if self.num_quantizers < 2:
            raise ValueError("decoder_config.num_quantizers must be at least 2 (1 semantic + acoustic)")
        if self.decoder_dim % 2 ** len(self.upsample_rates):
            raise ValueError("decoder_config.decoder_dim must halve cleanly once per upsample rate")

    @property
    def total_upsample(self) -> int:
        """Waveform samples per code frame (1920 for the released checkpoints)."""
        return math.prod(self.upsample_rates) * math.prod(self.upsampling_ratios)


@dataclass(frozen=True)
class CodecEncoderConfig:
    """transformers.MimiConfig, the subset that shapes the encoder half (the Mimi decoder half is unused)."""

    sampling_rate: int = 24000
    audio_channels: int = 1
    hidden_size: int = 512
    num_filters: int = 64
    num_residual_layers: int = 1
    upsampling_ratios: tuple[int, ...] = (8, 6, 5, 4)
    kernel_size: int = 7
    last_kernel_size: int = 3
    residual_kernel_size: int = 3
    dilation_growth_rate: int = 2
    use_causal_conv: bool = True
    pad_mode: str = "constant"
    compress: int = 2
    codebook_size: int = 2048
    codebook_dim: int = 256
    num_quantizers: int = 32
    num_semantic_quantizers: int = 1
    use_conv_shortcut: bool = False
    vector_quantization_hidden_dimension: int = 256
    upsample_groups: int = 512
    num_hidden_layers: int = 8
    intermediate_size: int = 2048
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int | None = None
    hidden_act: str = "gelu"
    max_position_embeddings: int = 8000
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    sliding_window: int = 250  # present in the file; transformers' Mimi attends causally without a window
    layer_scale_initial_scale: float = 0.01
    attention_bias: bool = False
    frame_rate: float | None = None  # "_frame_rate" in the file

    def __post_init__(self):
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.frame_rate is None:
            object.__setattr__(self, "frame_rate", self.sampling_rate / self._frame_size())
        if not self.use_causal_conv:
            raise ValueError("encoder_config.use_causal_conv: only causal convolutions are supported")
        if self.pad_mode != "constant":
            raise ValueError(f"encoder_config.pad_mode: only 'constant' is supported, got {self.pad_mode!r}")
        if self.use_conv_shortcut:
            raise ValueError("encoder_config.use_conv_shortcut: not supported (the released codec has none)")
        if self.hidden_act != "gelu":
            raise ValueError(f"encoder_config.hidden_act: only 'gelu' is supported, got {self.hidden_act!r}")
        if self.vector_quantization_hidden_dimension != self.codebook_dim:
            raise ValueError("encoder_config: vector_quantization_hidden_dimension must equal codebook_dim")

    def _frame_size(self) -> int:
        # MimiConfig.frame_size: every encoder conv stride, then the stride-2 downsample.
        return math.prod(self.upsampling_ratios) * 2

    @property
    def encodec_frame_rate(self) -> int:
        """Frame rate after the SEANet convolutions, before the downsample (25 for the released codec)."""
        return math.ceil(self.sampling_rate / math.prod(self.upsampling_ratios))

    @property
    def has_downsample(self) -> bool:
        return self.frame_rate != self.encodec_frame_rate

    @property
    def downsample_stride(self) -> int:
        return 2 * int(self.encodec_frame_rate / self.frame_rate)


@dataclass(frozen=True)
class CodecConfig:
    """The whole speech tokenizer: encoder + decoder and the sample rates around them."""

    encoder: CodecEncoderConfig = field(default_factory=CodecEncoderConfig)
    decoder: CodecDecoderConfig = field(default_factory=CodecDecoderConfig)
    encoder_valid_num_quantizers: int = 16
    input_sample_rate: int = 24000
    output_sample_rate: int = 24000
    decode_upsample_rate: int = 1920
    encode_downsample_rate: int = 1920

    def __post_init__(self):
        if self.decoder.total_upsample != self.decode_upsample_rate:
            raise ValueError(
                f"decode_upsample_rate {self.decode_upsample_rate} does not match the decoder's upsampling "
                f"{self.decoder.total_upsample} (prod(upsample_rates) * prod(upsampling_ratios))"
            )
        if self.encoder_valid_num_quantizers != self.decoder.num_quantizers:
            raise ValueError(
                f"encoder_valid_num_quantizers {self.encoder_valid_num_quantizers} != decoder num_quantizers "
                f"{self.decoder.num_quantizers}: encoded reference codes could not be decoded"
            )
        if self.encoder_valid_num_quantizers > self.encoder.num_quantizers:
            raise ValueError("encoder_valid_num_quantizers exceeds the encoder's num_quantizers")

    @property
    def num_quantizers(self) -> int:
        return self.decoder.num_quantizers

    @classmethod
    def from_dict(cls, raw: dict) -> "CodecConfig":
        model_type = raw.get("model_type", MODEL_TYPE)
        if model_type != MODEL_TYPE:
            raise ValueError(
                f"speech tokenizer model_type {model_type!r} is not supported; only {MODEL_TYPE!r} (the 12 Hz codec)"
            )
        enc_raw = dict(raw.get("encoder_config") or {})
        if "_frame_rate" in enc_raw and "frame_rate" not in enc_raw:
            enc_raw["frame_rate"] = enc_raw["_frame_rate"]
        encoder = CodecEncoderConfig(**_pick(CodecEncoderConfig, enc_raw, "encoder_config"))
        decoder = CodecDecoderConfig(**_pick(CodecDecoderConfig, raw.get("decoder_config") or {}, "decoder_config"))
        top = {k: raw[k] for k in ("encoder_valid_num_quantizers", "input_sample_rate", "output_sample_rate",
                                   "decode_upsample_rate", "encode_downsample_rate") if k in raw}
        return cls(encoder=encoder, decoder=decoder, **top)

    @classmethod
    def from_dir(cls, speech_tokenizer_dir: str | Path) -> "CodecConfig":
        """Read <checkpoint>/speech_tokenizer/config.json (pass the speech_tokenizer directory)."""
        path = Path(speech_tokenizer_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"speech tokenizer config not found: {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from exc
        try:
            return cls.from_dict(raw)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: {exc}") from exc

    def to_dict(self) -> dict:
        """The official config.json layout (what Qwen3TTSTokenizerV2Config.from_pretrained reads)."""
        enc = asdict(self.encoder)
        enc["_frame_rate"] = enc.pop("frame_rate")
        enc["model_type"] = "mimi"
        dec = asdict(self.decoder)
        for d in (enc, dec):
            for k, v in d.items():
                if isinstance(v, tuple):
                    d[k] = list(v)
        return {
            "architectures": ["Qwen3TTSTokenizerV2Model"],
            "model_type": MODEL_TYPE,
            "encoder_config": enc,
            "decoder_config": dec,
            "encoder_valid_num_quantizers": self.encoder_valid_num_quantizers,
            "input_sample_rate": self.input_sample_rate,
            "output_sample_rate": self.output_sample_rate,
            "decode_upsample_rate": self.decode_upsample_rate,
            "encode_downsample_rate": self.encode_downsample_rate,
        }


def released_codec_config() -> CodecConfig:
    """The speech tokenizer shipped with every Qwen3-TTS-12Hz checkpoint (for full-size dummy checkpoints)."""
    return CodecConfig(
        encoder=CodecEncoderConfig(frame_rate=12.5),
        decoder=CodecDecoderConfig(hidden_size=512, intermediate_size=1024, head_dim=64),
    )


def tiny_codec_config() -> CodecConfig:
    """A few-hundred-kB codec with the released strides (1920 samples per frame) and 2048-entry codebooks,
    so codes from a tiny talker decode and tests run in seconds on a CPU."""
    return CodecConfig(
        encoder=CodecEncoderConfig(
            hidden_size=32, num_filters=4, codebook_dim=16, vector_quantization_hidden_dimension=16,
            num_hidden_layers=2, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
            upsample_groups=32, frame_rate=12.5,
        ),
        decoder=CodecDecoderConfig(
            codebook_dim=32, latent_dim=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, head_dim=8, decoder_dim=32,
        ),
    )
