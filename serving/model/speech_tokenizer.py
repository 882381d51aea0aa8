"""The speech_tokenizer/ directory of a checkpoint: config, codec encoder + decoder weights, and the writer of
random ones for tests and dummy checkpoints.

Keys in speech_tokenizer/model.safetensors are "encoder.*" (Mimi, reference audio -> codes) and "decoder.*"
(codes -> waveform); this module's state_dict has exactly those names.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from serving.model import weights
from serving.model.codec_config import CodecConfig
from serving.model.codec_decoder import CodecDecoder
from serving.model.codec_decoder import init_random_ as init_decoder_random_
from serving.model.codec_encoder import CodecEncoder
from serving.model.codec_encoder import init_random_ as init_encoder_random_

# What transformers' AutoFeatureExtractor reads (the official loader requires the file).
PREPROCESSOR_CONFIG = {
    "chunk_length_s": None,
    "feature_extractor_type": "EncodecFeatureExtractor",
    "feature_size": 1,
    "overlap": None,
    "padding_side": "right",
    "padding_value": 0.0,
    "return_attention_mask": True,
    "sampling_rate": 24000,
}


class SpeechTokenizer(nn.Module):
    def __init__(self, config: CodecConfig):
        super().__init__()
        self.config = config
        self.encoder = CodecEncoder(config)
        self.decoder = CodecDecoder(config.decoder)

    @classmethod
    def load(cls, directory: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
             load_format: str = "auto") -> "SpeechTokenizer":
        """Build from <directory>/config.json and load <directory>/model.safetensors (load_format "dummy":
        random weights, same architecture). The codebooks and decoder are exact in float32; bf16 is for speed."""
        directory = Path(directory)
        if load_format not in weights.LOAD_FORMATS:
            raise ValueError(f"load_format {load_format!r} is not one of {weights.LOAD_FORMATS}")
        config = CodecConfig.from_dir(directory)
        with torch.device("meta"):
            module = cls(config)
        module = weights.materialize(module, torch.float32, device)
        if load_format == "dummy":
            init_random_(module, seed=0)
        else:
            weights.load_safetensors_(module, weights.safetensors_files(directory), source=str(directory))
        return module.to(weights.resolve_dtype(dtype)).eval()


@torch.no_grad()
def init_random_(module: SpeechTokenizer, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    init_encoder_random_(module.encoder, generator)
    init_decoder_random_(module.decoder, generator)


def write_random_speech_tokenizer(directory: str | Path, config: CodecConfig, seed: int = 0) -> Path:
    """Write config.json, preprocessor_config.json and model.safetensors (fp32, like the released file) with
    random weights that make the decoder depend on the codes and the encoder on the audio."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    module = SpeechTokenizer(config)
    init_random_(module, seed)
    tensors = {name: t.detach().contiguous() for name, t in module.state_dict().items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    (directory / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2) + "\n")
    return directory
