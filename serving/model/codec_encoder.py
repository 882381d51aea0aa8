"""12 Hz codec encoder (Mimi): reference audio -> 16 codes per 1920 samples, for voice cloning with a reference.

Reference audio at any sample rate is mixed to mono and resampled to 24 kHz (soxr HQ, as the official code via
librosa), then:
  (B, 1, L) -> SEANet conv encoder, strides 4, 5, 6, 8 (B, 512, L/960) -> 8-layer causal transformer
  -> stride-2 downsample conv (B, 512, L/1920) -> split RVQ: codebook 0 from the semantic quantizer,
  codebooks 1..15 from the first 15 of the 31 acoustic ones (the checkpoint holds 32 codebooks; the talker
  uses the first 16) -> codes (T, 16), T = ceil(L / 1920).
This is transformers' MimiModel.encode as the official Qwen3TTSTokenizerV2Model calls it (full causal attention:
transformers' Mimi ignores the config's sliding_window; nearest codebook vector by torch.cdist + argmin).
Parameter names equal the official ones ("encoder." in speech_tokenizer/model.safetensors).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from serving.model.codec_config import CodecConfig, CodecEncoderConfig
from serving.model.codec_decoder import rope_tables
from serving.model.layers import rotate_half
from serving.model.resample import resample
from serving.model.weights import weights_stamp


class MimiConv1d(nn.Module):
    """Causal Conv1d: left padding kernel - stride, plus right padding so the last window is complete."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, dilation: int = 1,
                 bias: bool = True, pad_mode: str = "constant"):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, stride, dilation=dilation, bias=bias)
        self.stride = stride
        self.kernel_size = (kernel_size - 1) * dilation + 1
        self.padding_total = self.kernel_size - stride
        self.pad_mode = pad_mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[-1]
        n_frames = math.ceil((length - self.kernel_size + self.padding_total) / self.stride + 1) - 1
        extra = n_frames * self.stride + self.kernel_size - self.padding_total - length
        if self.pad_mode == "constant":
            x = F.pad(x, (self.padding_total, extra))
        else:
            x = F.pad(x, (self.padding_total, extra), mode=self.pad_mode)
        return self.conv(x)


class MimiResnetBlock(nn.Module):
    def __init__(self, config: CodecEncoderConfig, dim: int, dilations: tuple[int, int]):
        super().__init__()
        hidden = dim // config.compress
        self.block = nn.ModuleList([
            nn.ELU(), MimiConv1d(dim, hidden, config.residual_kernel_size, dilation=dilations[0]),
            nn.ELU(), MimiConv1d(hidden, dim, 1, dilation=dilations[1]),
        ])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.block:
            h = layer(h)
        return x + h


class SEANetEncoder(nn.Module):
    def __init__(self, config: CodecEncoderConfig):
        super().__init__()
        layers: list[nn.Module] = [MimiConv1d(config.audio_channels, config.num_filters, config.kernel_size)]
        scaling = 1
        for ratio in reversed(config.upsampling_ratios):
            dim = scaling * config.num_filters
            for j in range(config.num_residual_layers):
                layers.append(MimiResnetBlock(config, dim, (config.dilation_growth_rate ** j, 1)))
            layers += [nn.ELU(), MimiConv1d(dim, dim * 2, kernel_size=ratio * 2, stride=ratio)]
            scaling *= 2
        layers += [nn.ELU(), MimiConv1d(scaling * config.num_filters, config.hidden_size, config.last_kernel_size)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class LayerScale(nn.Module):
    def __init__(self, dim: int, initial_scale: float):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), initial_scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class MimiAttention(nn.Module):
    def __init__(self, config: CodecEncoderConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                            config.head_dim)
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)

    def forward(self, x_btc: torch.Tensor, cos_tk: torch.Tensor, sin_tk: torch.Tensor) -> torch.Tensor:
        b, t, _ = x_btc.shape
        q = self.q_proj(x_btc).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x_btc).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x_btc).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos_tk + rotate_half(q) * sin_tk
        k = k * cos_tk + rotate_half(k) * sin_tk
        out = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MimiMLP(nn.Module):
    def __init__(self, config: CodecEncoderConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MimiTransformerLayer(nn.Module):
    def __init__(self, config: CodecEncoderConfig):
        super().__init__()
        self.self_attn = MimiAttention(config)
        self.mlp = MimiMLP(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.self_attn_layer_scale = LayerScale(config.hidden_size, config.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(config.hidden_size, config.layer_scale_initial_scale)

    def forward(self, x, cos_tk, sin_tk):
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos_tk, sin_tk))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class MimiTransformer(nn.Module):
    def __init__(self, config: CodecEncoderConfig):
        super().__init__()
        self.head_dim, self.rope_theta = config.head_dim, float(config.rope_theta)
        self.layers = nn.ModuleList([MimiTransformerLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, x_btc: torch.Tensor) -> torch.Tensor:
        cos_tk, sin_tk = rope_tables(x_btc.shape[1], self.head_dim, self.rope_theta, x_btc.device, x_btc.dtype)
        for layer in self.layers:
            x_btc = layer(x_btc, cos_tk, sin_tk)
        return x_btc


class EuclideanCodebook(nn.Module):
    def __init__(self, codebook_size: int, dim: int):
        super().__init__()
        self.register_buffer("initialized", torch.tensor([True], dtype=torch.float32))
        self.register_buffer("cluster_usage", torch.ones(codebook_size))
        self.register_buffer("embed_sum", torch.zeros(codebook_size, dim))
        self._kept: tuple[tuple, torch.Tensor, torch.Tensor] | None = None  # (stamp, vectors, their cdist side)

    def _codebook(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(vectors (K, D), their side of torch.cdist's matrix product (K, D + 2)), computed once for the buffers
        as they are: a voice's encoding runs 16 codebooks, and recomputing both made ~7 of each one's ~18 kernel
        launches (the encoder is launch-bound on a GPU, benchmarks/voice_encode_bench.py). New weights (loaded or
        drawn in place, or moved) have another stamp."""
        stamp = weights_stamp((self.embed_sum, self.cluster_usage))
        if self._kept is None or self._kept[0] != stamp:
            vectors = self.embed_sum / self.cluster_usage.clamp(min=1e-5)[:, None]
            side = vectors.float()
            norm = side.pow(2).sum(-1, keepdim=True)
            self._kept = (stamp, vectors, torch.cat([side, torch.ones_like(norm), norm], -1))
        return self._kept[1], self._kept[2]


def nearest_codes(x_nd: torch.Tensor, side_kd: torch.Tensor) -> torch.Tensor:
    """Each row's nearest codebook vector, as the official quantize finds it (torch.cdist, p=2, then argmin):
    cdist's own matrix-product form for over 25 vectors, term for term, with the codebook's side of it kept
    (EuclideanCodebook._codebook)."""
    x = x_nd.float()
    norm = x.pow(2).sum(-1, keepdim=True)
    rows = torch.cat([x.mul(-2), norm, torch.ones_like(norm)], -1)
    return rows[None].matmul(side_kd[None].transpose(-2, -1)).clamp_min_(0).sqrt_()[0].argmin(dim=-1)


class _CodebookHolder(nn.Module):
    """Gives the official key path `...layers.N.codebook.*`."""

    def __init__(self, codebook_size: int, dim: int):
        super().__init__()
        self.codebook = EuclideanCodebook(codebook_size, dim)


class MimiResidualVectorQuantizer(nn.Module):
    def __init__(self, config: CodecEncoderConfig, num_quantizers: int):
        super().__init__()
        self.layers = nn.ModuleList(_CodebookHolder(config.codebook_size, config.codebook_dim)
                                    for _ in range(num_quantizers))
        self.input_proj = nn.Conv1d(config.hidden_size, config.vector_quantization_hidden_dimension, 1, bias=False)
        # used by Mimi's decoder only; kept so the checkpoint loads strictly
        self.output_proj = nn.Conv1d(config.vector_quantization_hidden_dimension, config.hidden_size, 1, bias=False)

    def codebooks(self, num_quantizers: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(vectors, sides) of the first num_quantizers codebooks, as encode takes them (kept: _codebook)."""
        books = [holder.codebook._codebook() for holder in self.layers[:num_quantizers]]
        return [vectors for vectors, _ in books], [side for _, side in books]

    def encode(self, embeddings_bct: torch.Tensor, vectors: list[torch.Tensor],
               sides: list[torch.Tensor]) -> torch.Tensor:
        """(B, hidden, T) -> (codebooks, B, T) codes, each codebook quantizing what the previous left."""
        residual_btd = self.input_proj(embeddings_bct).permute(0, 2, 1)
        b, t, d = residual_btd.shape[0], residual_btd.shape[1], residual_btd.shape[2]
        all_codes = []
        for vectors_kd, side_kd in zip(vectors, sides):
            codes_bt = nearest_codes(residual_btd.reshape(-1, d), side_kd).view(b, t)
            residual_btd = residual_btd - F.embedding(codes_bt, vectors_kd)
            all_codes.append(codes_bt)
        return torch.stack(all_codes)


class MimiSplitResidualVectorQuantizer(nn.Module):
    def __init__(self, config: CodecEncoderConfig):
        super().__init__()
        self.num_semantic = config.num_semantic_quantizers
        self.semantic_residual_vector_quantizer = MimiResidualVectorQuantizer(config, self.num_semantic)
        self.acoustic_residual_vector_quantizer = MimiResidualVectorQuantizer(
            config, config.num_quantizers - self.num_semantic)

    def codebooks(self, num_quantizers: int) -> tuple[list[torch.Tensor], ...]:
        """(semantic vectors, sides, acoustic vectors, sides) of the first num_quantizers codebooks, for encode."""
        semantic = self.semantic_residual_vector_quantizer.codebooks(self.num_semantic)
        acoustic = self.acoustic_residual_vector_quantizer.codebooks(max(0, num_quantizers - self.num_semantic))
        return semantic + acoustic

    def encode(self, embeddings_bct: torch.Tensor, semantic_vectors: list[torch.Tensor],
               semantic_sides: list[torch.Tensor], acoustic_vectors: list[torch.Tensor],
               acoustic_sides: list[torch.Tensor]) -> torch.Tensor:
        codes = self.semantic_residual_vector_quantizer.encode(embeddings_bct, semantic_vectors, semantic_sides)
        if len(acoustic_vectors) > 0:
            acoustic = self.acoustic_residual_vector_quantizer.encode(embeddings_bct, acoustic_vectors, acoustic_sides)
            codes = torch.cat([codes, acoustic], dim=0)
        return codes


class CodecEncoder(nn.Module):
    def __init__(self, config: CodecConfig):
        super().__init__()
        enc = config.encoder
        self.config = config
        self.encoder = SEANetEncoder(enc)
        self.encoder_transformer = MimiTransformer(enc)
        self.downsample = (MimiConv1d(enc.hidden_size, enc.hidden_size, kernel_size=enc.downsample_stride, stride=2,
                                      bias=False, pad_mode="replicate") if enc.has_downsample else None)
        self.quantizer = MimiSplitResidualVectorQuantizer(enc)

    def forward(self, wav_bl: torch.Tensor, semantic_vectors: list[torch.Tensor], semantic_sides: list[torch.Tensor],
                acoustic_vectors: list[torch.Tensor], acoustic_sides: list[torch.Tensor]) -> torch.Tensor:
        """(B, samples) 24 kHz -> (B, frames, codebooks) codes, given the codebooks (quantizer.codebooks, kept
        outside so that this compiles to TorchScript); frames may run one past the audio (the last frame of
        padding), see encode()."""
        h = self.encoder(wav_bl.unsqueeze(1))
        h = self.encoder_transformer(h.transpose(1, 2)).transpose(1, 2)
        if self.downsample is not None:
            h = self.downsample(h)
        codes_qbt = self.quantizer.encode(h, semantic_vectors, semantic_sides, acoustic_vectors, acoustic_sides)
        return codes_qbt.permute(1, 2, 0)

    @torch.inference_mode()
    def encode(self, audios: list[np.ndarray], sample_rate: int, net: nn.Module | None = None) -> list[torch.Tensor]:
        """Mono audio clips at sample_rate -> one (ceil(samples_24k / 1920), 16) int64 code tensor each.
        Clips are right-padded with zeros to a batch, as the official batched encode does; the encoder is causal,
        so only a clip's last frame, when partly padding, can differ from encoding the clip alone. `net` runs
        forward in this module's place: its TorchScript (serving.engine.prompts), on the server's voice thread."""
        if not audios:
            return []
        target = self.config.input_sample_rate
        clips = [resample(a, sample_rate, target) for a in audios]
        for i, clip in enumerate(clips):
            if clip.shape[0] == 0:
                raise ValueError(f"reference audio {i} is empty")
            if not np.isfinite(clip).all():
                raise ValueError(f"reference audio {i} contains NaN or infinite samples")
        param = next(self.parameters())
        batch = torch.zeros(len(clips), max(c.shape[0] for c in clips), dtype=param.dtype, device=param.device)
        for i, clip in enumerate(clips):
            batch[i, : clip.shape[0]] = torch.from_numpy(clip)
        books = self.quantizer.codebooks(self.config.encoder_valid_num_quantizers)
        codes_btq = (self if net is None else net)(batch, *books)
        hop = self.config.encode_downsample_rate
        return [codes_btq[i, : -(-clip.shape[0] // hop)].cpu() for i, clip in enumerate(clips)]


@torch.no_grad()
def init_random_(encoder: CodecEncoder, generator: torch.Generator) -> None:
    """Every tensor drawn at a scale that keeps activations O(1), and codebooks spread over the scale of what they
    quantize, so codes vary with the audio."""

    def normal_(t: torch.Tensor, std: float, mean: float = 0.0) -> None:
        t.copy_(torch.randn(t.shape, generator=generator) * std + mean)

    for module in encoder.modules():
        if isinstance(module, nn.Conv1d):
            normal_(module.weight, 1.0 / math.sqrt(module.weight[0].numel()))
            if module.bias is not None:
                normal_(module.bias, 0.02)
        elif isinstance(module, nn.Linear):
            normal_(module.weight, 1.0 / math.sqrt(module.in_features))
        elif isinstance(module, nn.LayerNorm):
            normal_(module.weight, 0.1, mean=1.0)
            normal_(module.bias, 0.02)
        elif isinstance(module, LayerScale):
            normal_(module.scale, 0.02, mean=0.2)
        elif isinstance(module, EuclideanCodebook):
            module.cluster_usage.copy_(0.5 + torch.rand(module.cluster_usage.shape, generator=generator))
            module.initialized.fill_(1.0)
    # codebook vectors at the scale of the projected embeddings of a noise-like input
    probe = torch.randn(1, 4 * encoder.config.encode_downsample_rate, generator=generator) * 0.1
    h = encoder.encoder(probe.unsqueeze(1).to(next(encoder.parameters()).device))
    h = encoder.encoder_transformer(h.transpose(1, 2)).transpose(1, 2)
    if encoder.downsample is not None:
        h = encoder.downsample(h)
    for rvq in (encoder.quantizer.semantic_residual_vector_quantizer, encoder.quantizer.acoustic_residual_vector_quantizer):
        scale = float(rvq.input_proj(h).std())
        for i, holder in enumerate(rvq.layers):
            cb = holder.codebook
            normal_(cb.embed_sum, scale * 0.7 ** i)
            cb.embed_sum.mul_(cb.cluster_usage[:, None])  # stored as sum = vector * usage
