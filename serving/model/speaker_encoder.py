"""ECAPA-TDNN speaker encoder of the Base checkpoints: reference audio -> x-vector (the voice-clone speaker slot).

log-mel (B, T, 128) -> TDNN 128->512 k5 -> 3 SE-Res2Net blocks (512, k3, dilations 2/3/4, scale 8, SE 128)
-> concat of the three block outputs (1536) -> TDNN 1536->1536 (multi-layer feature aggregation)
-> attentive statistics pooling (attention 128) -> mean ++ std (3072) -> 1x1 conv -> (B, enc_dim).
All convolutions use "same" reflect padding. Parameter names equal the official Qwen3TTSSpeakerEncoder's
("speaker_encoder." in model.safetensors). Variable-length batches are not supported (the official pooling has
no padding mask either): encode one utterance per call, or equal-length utterances.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from serving.model import mel as mel_frontend
from serving.model.resample import resample


@dataclass(frozen=True)
class SpeakerEncoderConfig:
    """config.json's speaker_encoder_config (Qwen3TTSSpeakerEncoderConfig defaults)."""

    mel_dim: int = 128
    enc_dim: int = 1024
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = 24000

    def __post_init__(self):
        if not len(self.enc_channels) == len(self.enc_kernel_sizes) == len(self.enc_dilations):
            raise ValueError("speaker_encoder_config: enc_channels, enc_kernel_sizes and enc_dilations "
                             "must have the same length")
        if len(self.enc_channels) < 3:
            raise ValueError("speaker_encoder_config: enc_channels needs at least 3 entries")
        if self.mel_dim != mel_frontend.N_MELS or self.sample_rate != mel_frontend.SAMPLE_RATE:
            raise ValueError(f"speaker_encoder_config: the mel front end is fixed at {mel_frontend.N_MELS} mels, "
                             f"{mel_frontend.SAMPLE_RATE} Hz (got mel_dim={self.mel_dim}, sample_rate={self.sample_rate})")

    @classmethod
    def from_dict(cls, raw: dict) -> "SpeakerEncoderConfig":
        """Keys the official class knows; others (e.g. "model_type", which its own save writes) are ignored."""
        kwargs = {}
        for f in fields(cls):
            if f.name in raw:
                value = raw[f.name]
                kwargs[f.name] = tuple(int(v) for v in value) if str(f.type).startswith("tuple") else value
        return cls(**kwargs)

    def to_dict(self) -> dict:
        return {f.name: list(getattr(self, f.name)) if isinstance(getattr(self, f.name), tuple)
                else getattr(self, f.name) for f in fields(self)}


def tiny_speaker_encoder_config(enc_dim: int) -> SpeakerEncoderConfig:
    """Narrow channels, same structure, for tests (enc_dim = the tiny talker's hidden size)."""
    return SpeakerEncoderConfig(enc_dim=enc_dim, enc_channels=(16, 16, 16, 16, 48), enc_attention_channels=8,
                                enc_se_channels=8)


class TimeDelayNetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, padding="same",
                              padding_mode="reflect")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added outside the convolution: without cuDNN (as voices are encoded, serving/engine/prompts.py)
        # a dilated convolution with a bias fills its output one channel at a time, 64 kernels apiece, 1,344 of
        # the network's 1,556 launches on an H100 (benchmarks/voice_encode_bench.py --profile).
        bias = self.conv.bias
        assert bias is not None
        return F.relu(self.conv._conv_forward(x, self.conv.weight, None) + bias.unsqueeze(-1))


class Res2NetBlock(nn.Module):
    """Channels split in `scale` groups; group i > 0 goes through its own TDNN after adding group i-1's output."""

    def __init__(self, channels: int, scale: int, kernel_size: int, dilation: int):
        super().__init__()
        self.scale = scale
        self.blocks = nn.ModuleList(
            TimeDelayNetBlock(channels // scale, channels // scale, kernel_size, dilation) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.chunk(x, self.scale, dim=1)
        out = parts[0]
        outputs = [out]
        for i, block in enumerate(self.blocks):
            out = block(parts[i + 1] if i == 0 else parts[i + 1] + out)
            outputs.append(out)
        return torch.cat(outputs, dim=1)


class SqueezeExcitationBlock(nn.Module):
    def __init__(self, channels: int, se_channels: int):
        super().__init__()
        self.conv1 = nn.Conv1d(channels, se_channels, 1, padding="same", padding_mode="reflect")
        self.conv2 = nn.Conv1d(se_channels, channels, 1, padding="same", padding_mode="reflect")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * gate


class SqueezeExcitationRes2NetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, scale: int, se_channels: int, kernel_size: int,
                 dilation: int):
        super().__init__()
        self.tdnn1 = TimeDelayNetBlock(in_channels, out_channels, 1, 1)
        self.res2net_block = Res2NetBlock(out_channels, scale, kernel_size, dilation)
        self.tdnn2 = TimeDelayNetBlock(out_channels, out_channels, 1, 1)
        self.se_block = SqueezeExcitationBlock(out_channels, se_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x)))) + x


def _weighted_statistics(x_bct: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean_bc = (weights * x_bct).sum(2)
    std_bc = torch.sqrt((weights * (x_bct - mean_bc.unsqueeze(2)).pow(2)).sum(2).clamp(1e-12))
    return mean_bc, std_bc


class AttentiveStatisticsPooling(nn.Module):
    """Attention over time from each frame plus the utterance's global mean and std; returns weighted mean ++ std."""

    def __init__(self, channels: int, attention_channels: int):
        super().__init__()
        self.tdnn = TimeDelayNetBlock(channels * 3, attention_channels, 1, 1)
        self.conv = nn.Conv1d(attention_channels, channels, 1, padding="same", padding_mode="reflect")

    def forward(self, x_bct: torch.Tensor) -> torch.Tensor:
        t = x_bct.shape[-1]
        uniform = torch.full((x_bct.shape[0], 1, t), 1.0 / t, dtype=x_bct.dtype, device=x_bct.device)
        mean_bc, std_bc = _weighted_statistics(x_bct, uniform)
        context = torch.cat([x_bct, mean_bc.unsqueeze(2).expand(-1, -1, t), std_bc.unsqueeze(2).expand(-1, -1, t)], 1)
        attention = F.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        mean_bc, std_bc = _weighted_statistics(x_bct, attention)
        return torch.cat((mean_bc, std_bc), dim=1).unsqueeze(2)


class SpeakerEncoder(nn.Module):
    def __init__(self, config: SpeakerEncoderConfig):
        super().__init__()
        self.config = config
        ch, ks, dil = config.enc_channels, config.enc_kernel_sizes, config.enc_dilations
        self.blocks = nn.ModuleList(
            [TimeDelayNetBlock(config.mel_dim, ch[0], ks[0], dil[0])]
            + [SqueezeExcitationRes2NetBlock(ch[i - 1], ch[i], config.enc_res2net_scale, config.enc_se_channels,
                                             ks[i], dil[i]) for i in range(1, len(ch) - 1)]
        )
        self.mfa = TimeDelayNetBlock(ch[-1], ch[-1], ks[-1], dil[-1])
        self.asp = AttentiveStatisticsPooling(ch[-1], config.enc_attention_channels)
        self.fc = nn.Conv1d(ch[-1] * 2, config.enc_dim, 1, padding="same", padding_mode="reflect")

    def forward(self, mels_btm: torch.Tensor) -> torch.Tensor:
        """(B, frames, mel_dim) log mel -> (B, enc_dim) x-vectors."""
        h = mels_btm.transpose(1, 2)
        block_outputs = []
        for block in self.blocks:
            h = block(h)
            block_outputs.append(h)
        h = self.mfa(torch.cat(block_outputs[1:], dim=1))
        return self.fc(self.asp(h)).squeeze(-1)

    @torch.inference_mode()
    def embed(self, audio: np.ndarray, sample_rate: int, net: nn.Module | None = None) -> torch.Tensor:
        """Mono audio at any rate -> (enc_dim,) x-vector, as the official create_voice_clone_prompt computes it.
        `net` runs forward in this module's place: its TorchScript (serving.engine.prompts), on the server's voice
        thread."""
        wav = resample(audio, sample_rate, self.config.sample_rate)
        param = next(self.parameters())
        mels = mel_frontend.log_mel_spectrogram(torch.from_numpy(wav).unsqueeze(0).to(param.device))
        return (self if net is None else net)(mels.to(param.dtype))[0]


def build_speaker_encoder(raw_config: dict) -> SpeakerEncoder:
    """From config.json's speaker_encoder_config dict."""
    return SpeakerEncoder(SpeakerEncoderConfig.from_dict(raw_config))


@torch.no_grad()
def init_random_(encoder: SpeakerEncoder, generator: torch.Generator) -> None:
    """Every weight and bias drawn at a scale that keeps activations O(1), so x-vectors depend on the audio."""
    for module in encoder.modules():
        if isinstance(module, nn.Conv1d):
            fan_in = module.weight[0].numel()
            module.weight.copy_(torch.randn(module.weight.shape, generator=generator) / math.sqrt(fan_in))
            module.bias.copy_(torch.randn(module.bias.shape, generator=generator) * 0.05)
