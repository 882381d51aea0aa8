"""The Qwen3-TTS module tree whose state_dict keys equal the official model.safetensors names:
`talker.*` always, `speaker_encoder.*` on Base (voice clone) checkpoints."""

from __future__ import annotations

from torch import nn

from serving.model.config import ModelConfig
from serving.model.talker import Talker


class Qwen3TTSModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.talker = Talker(cfg.talker)
        if cfg.tts_model_type == "base":
            from serving.model.speaker_encoder import SpeakerEncoder, SpeakerEncoderConfig

            spk_cfg = SpeakerEncoderConfig.from_dict(cfg.speaker_encoder)
            if spk_cfg.enc_dim != cfg.talker.transformer.hidden_size:
                raise ValueError(f"speaker_encoder_config.enc_dim {spk_cfg.enc_dim} != talker hidden_size "
                                 f"{cfg.talker.transformer.hidden_size}: x-vectors fill a talker input slot")
            self.speaker_encoder = SpeakerEncoder(spk_cfg)
        else:
            self.speaker_encoder = None
