"""12 Hz codec decoder: 16 codes per frame -> 1920 waveform samples at 24 kHz.

Pipeline (shapes for the released codec, B requests, T frames):
  codes (B, T, 16) -> split RVQ (1 semantic + 15 acoustic codebooks, 256 wide, projected to 512) (B, 512, T)
  -> causal conv k3 (B, 1024, T) -> transformer (sliding window 72, LayerScale) (B, 1024, T)
  -> 2 x [causal ConvTranspose x2 + ConvNeXt] (B, 1024, 4T) -> causal conv k7 (B, 1536, 4T)
  -> 4 x [SnakeBeta, causal ConvTranspose x r, 3 residual units] for r = 8, 5, 4, 3 (B, 96, 1920T)
  -> SnakeBeta, causal conv k7, clamp(-1, 1) -> (B, 1920T)

Everything is causal, so the samples of a frame depend only on that frame and earlier ones. What a layer sees
of the time before its input comes from a `Frames` view that is threaded through the one traversal in
`CodecDecoder.run`: here, the one-shot view (nothing before the first frame: convolutions pad with zeros,
attention sees only this call's frames); in codec_stream.py, the streaming view (each row's carried state).

One-shot batches may hold rows of different lengths: rows are left-padded to a common length and `left_pad`
says how many leading frames of each row are padding; padded positions are zeroed before every convolution
and masked out of attention, so a padded row decodes exactly as it would alone. Shapes depend only on (B, T),
never on the data, so a forward can be captured as a CUDA graph per (batch, frames) bucket.

Parameter names equal the official Qwen3TTSTokenizerV2Decoder's ("decoder." in speech_tokenizer/model.safetensors).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from serving.model.codec_config import CodecDecoderConfig
from serving.model.layers import MLP, FusedProjections, RMSNorm, SlicedLinear, rms_norm, rotate_half
from serving.model.weights import weights_stamp


def channels_innermost(x_bcl: torch.Tensor) -> bool:
    """Whether a (B, C, L) tensor is laid out (B, L, C), as the engine's window products write activations."""
    return x_bcl.stride(1) == 1 and x_bcl.shape[1] > 1


class Frames:
    """The time axis of one forward at `rate` samples per frame, as its convolutions and attention see it.

    This is the one-shot view: nothing precedes the first frame, so a convolution's history is zeros and
    attention sees only this call's frames; keep_bt (B, T) bool marks each row's real frames after its left
    padding (None: no padding). codec_stream.StreamStep overrides the hooks to hand each row its carried state
    instead and to record the state the next chunk needs, so one traversal serves both.
    """

    past_frames = 0  # frames before this call whose keys and values attention sees
    wanted_only = False  # kernels may leave each row's padding uncomputed (valid): the vocoder's view (vocoding)

    def __init__(self, keep_bt: torch.Tensor | None = None):
        self.keep_bt = keep_bt
        self.rate = 1

    def upsampled(self, factor: int) -> "Frames":
        view = copy.copy(self)
        view.rate = self.rate * factor
        return view

    def with_history(self, module: nn.Module, x_bcl: torch.Tensor, n: int, act: nn.Module | None = None
                     ) -> torch.Tensor:
        """x (B, C, L) at this rate, or act(x), with the n inputs before it prepended: (B, C, n + L), laid out as
        x. act writes straight into the buffer behind the history (`out=`), which saves re-copying its output
        there."""
        if n == 0:
            return x_bcl if act is None else act(x_bcl, valid=self.valid())
        b, c, length = x_bcl.shape
        if channels_innermost(x_bcl):
            full = x_bcl.new_empty((b, n + length, c)).transpose(1, 2)
        else:
            full = x_bcl.new_empty((b, c, n + length))
        full[..., :n] = self.history(module, x_bcl, n)
        if act is None:
            full[..., n:] = x_bcl
        else:
            act(x_bcl, out=full[..., n:], valid=self.valid())
        return self.filled(module, full, n)

    def vocoding(self) -> "Frames":
        """This view for the convolutions after the transformer, which may leave a row's padding uncomputed (valid):
        they are causal, so no wanted sample reads it. Before them, padded keys and values meet attention, whose
        masked terms are zeros times whatever the padding holds (NaN times zero is NaN), so there it is computed."""
        view = copy.copy(self)
        view.wanted_only = True
        return view

    def valid(self) -> tuple[torch.Tensor, int] | None:
        """(each row's wanted frames (B,), samples per frame at this rate) where only a row's leading frames are
        wanted and the rest pads it (a stream step's rows, right-padded, in the vocoder's view), for kernels that
        skip the padding (serving/engine/triton_conv.window_product); None: every frame is computed (here: the
        one-shot decode, whose padding leads a row)."""
        return None

    def history(self, module: nn.Module, x_bcl: torch.Tensor, n: int) -> torch.Tensor:
        """The n inputs before x, (B, C, n) or broadcast to it: zeros here."""
        return x_bcl.new_zeros(())

    def filled(self, module: nn.Module, full: torch.Tensor, n: int) -> torch.Tensor:
        """with_history's (B, C, n + L) once its new inputs are written. Padding is zeroed, so a padded row's
        convolutions see zeros before its first real input, as alone."""
        if self.keep_bt is not None:
            full[..., n:].mul_(self.keep_bt.to(full.dtype).repeat_interleave(self.rate, dim=1)[:, None, :])
        return full

    def keys_values(self, module: nn.Module, kv_b2htd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (before RoPE) and values, given together (B, 2, heads, T, head_dim), with those of the past_frames
        earlier frames prepended to this call's: (B, heads, past_frames + T, head_dim) each."""
        return kv_b2htd[:, 0], kv_b2htd[:, 1]

    def attention_mask(self, num_frames: int, window: int, device) -> torch.Tensor:
        """(B or 1, 1, T, past_frames + T) bool: causal, within the window, key not padding (a query always sees
        itself, so padded rows stay finite)."""
        idx = torch.arange(num_frames, device=device)
        distance_tt = idx[:, None] - idx[None, :]
        allowed_tt = (distance_tt >= 0) & (distance_tt < window)
        if self.keep_bt is None:
            return allowed_tt[None, None]
        allowed_btt = allowed_tt[None] & self.keep_bt[:, None, :]
        return (allowed_btt | (distance_tt == 0)[None])[:, None]


class CausalConv1d(nn.Module):
    """Conv1d over its input with (k - 1) * dilation earlier inputs before it (stride 1 throughout the decoder),
    so output t sees inputs <= t."""

    product = None  # the engine's window product (serving/engine/triton_conv.py) for this conv; None: torch

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, groups=groups)
        self.left_pad = (kernel_size - 1) * dilation

    def forward(self, x: torch.Tensor, frames: Frames, act: nn.Module | None = None, then: nn.Module | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual + then(conv(act(x))), each part where given (see Frames.with_history for act)."""
        full = frames.with_history(self, x, self.left_pad, act)
        if self.product is not None:
            return self.product(full, then, residual, frames.valid())
        conv = self.conv
        y = F.conv1d(full, conv.weight, conv.bias, dilation=conv.dilation, groups=conv.groups)
        if then is not None:
            y = then(y)
        return y if residual is None else residual + y


class CausalConvTranspose1d(nn.Module):
    """ConvTranspose1d (kernel k = m * stride s): T -> s*T, output samples [s*t, s*(t+1)) from inputs t-m+1..t.

    The m - 1 earlier inputs are prepended (zeros at the start) and the samples they own cut, as are the
    k - s samples overhanging on the right, so a chunk's samples are exactly those of the one-shot decode."""

    product = None  # as CausalConv1d's: computes only the samples kept

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__()
        if kernel_size % stride:
            raise ValueError(f"transposed conv kernel {kernel_size} must be a multiple of its stride {stride}")
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.history = kernel_size // stride - 1

    def forward(self, x: torch.Tensor, frames: Frames, act: nn.Module | None = None) -> torch.Tensor:
        """Of act(x) if act is given (see Frames.with_history)."""
        full = frames.with_history(self, x, self.history, act)
        if self.product is not None:
            return self.product(full, None, None, frames.valid())
        y = self.conv(full)
        start = self.history * self.conv.stride[0]
        return y[..., start: start + x.shape[-1] * self.conv.stride[0]]


def snake_reference(x_bcl: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
                    out: torch.Tensor | None = None, valid: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """SnakeBeta of x: x + sin^2(x * e^alpha) / e^beta (alpha, beta as logs), into `out` (B, C, L), which may
    be a strided view, if given. Every sample, whatever `valid` says (SnakeBeta.kernel's signature)."""
    alpha = torch.exp(alpha)[None, :, None]
    beta = torch.exp(beta)[None, :, None]
    y = x_bcl + (1.0 / (beta + 1e-9)) * torch.pow(torch.sin(x_bcl * alpha), 2)
    return y if out is None else out.copy_(y)


class SnakeBeta(nn.Module):
    """x + sin^2(x * e^alpha) / e^beta per channel (alpha, beta stored as logs). `kernel` computes it: the torch
    reference, or a fused kernel the engine installs (serving/engine/triton_vocoder.py)."""

    kernel = staticmethod(snake_reference)

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None,
                valid: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
        """valid: as Frames.valid, for a kernel that skips the padding (the reference computes every sample)."""
        return self.kernel(x, self.alpha, self.beta, out=out, valid=valid)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, kernel_size=7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(1e-6 * torch.ones(dim))

    def forward(self, x_bct: torch.Tensor, frames: Frames) -> torch.Tensor:
        h_btc = self.dwconv(x_bct, frames).permute(0, 2, 1)
        h_btc = self.pwconv2(F.gelu(self.pwconv1(self.norm(h_btc))))
        return x_bct + (self.gamma * h_btc).permute(0, 2, 1)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, kernel_size=7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, kernel_size=1)

    def forward(self, x: torch.Tensor, frames: Frames) -> torch.Tensor:
        h = self.conv1(x, frames, act=self.act1, then=self.act2)
        return self.conv2(h, frames, residual=x)


class DecoderBlock(nn.Module):
    """SnakeBeta, upsample x rate (channels halve), three residual units (dilations 1, 3, 9)."""

    def __init__(self, in_dim: int, out_dim: int, rate: int):
        super().__init__()
        self.block = nn.ModuleList(
            [SnakeBeta(in_dim), CausalConvTranspose1d(in_dim, out_dim, 2 * rate, rate)]
            + [ResidualUnit(out_dim, d) for d in (1, 3, 9)]
        )
        self.rate = rate

    def forward(self, x: torch.Tensor, frames: Frames) -> torch.Tensor:
        """frames: the view at this block's input rate."""
        x = self.block[1](x, frames, act=self.block[0])
        frames = frames.upsampled(self.rate)
        for unit in self.block[2:]:
            x = unit(x, frames)
        return x


# --- split residual vector quantizer (decode side only) -------------------------------------------------------


class Codebook(nn.Module):
    """Stored as running sums (training-time EMA state); the vectors are embedding_sum / cluster_usage."""

    def __init__(self, codebook_size: int, dim: int):
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(codebook_size))
        self.embedding_sum = nn.Parameter(torch.zeros(codebook_size, dim))

    def usage(self) -> torch.Tensor:
        return self.cluster_usage.clamp(min=1e-5)

    def vectors(self) -> torch.Tensor:
        """Every code's vector (codebook_size, dim)."""
        return self.embedding_sum / self.usage()[:, None]

    def lookup(self, codes_bt: torch.Tensor) -> torch.Tensor:
        # Gather then divide: the same per-element quotient as dividing the whole table first, 2048x cheaper.
        return F.embedding(codes_bt, self.embedding_sum) / self.usage()[codes_bt].unsqueeze(-1)


class _CodebookHolder(nn.Module):
    """Gives the official key path `...layers.N._codebook.*`."""

    def __init__(self, codebook_size: int, dim: int):
        super().__init__()
        self._codebook = Codebook(codebook_size, dim)


class _LayerList(nn.Module):
    """Gives the official key path `...vq.layers.N`."""

    def __init__(self, num_quantizers: int, codebook_size: int, dim: int):
        super().__init__()
        self.layers = nn.ModuleList([_CodebookHolder(codebook_size, dim) for _ in range(num_quantizers)])


class ResidualVectorQuantizer(nn.Module):
    """Sum of the chosen vectors of each codebook, then a 1x1 projection to the decoder width.

    input_proj is only used when encoding (training); it is kept so the checkpoint loads strictly.
    """

    def __init__(self, num_quantizers: int, codebook_size: int, dim: int, io_dim: int):
        super().__init__()
        self.input_proj = nn.Conv1d(io_dim, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, io_dim, 1, bias=False)
        self.vq = _LayerList(num_quantizers, codebook_size, dim)

    def decode(self, codes_btq: torch.Tensor) -> torch.Tensor:
        summed_btd = None
        for q, holder in enumerate(self.vq.layers):
            vectors_btd = holder._codebook.lookup(codes_btq[:, :, q])
            summed_btd = vectors_btd if summed_btd is None else summed_btd + vectors_btd
        return self.output_proj(summed_btd.transpose(1, 2))


class SplitResidualVectorQuantizer(nn.Module):
    """Codebook 0 (semantic) and codebooks 1..15 (acoustic) have their own projections; outputs add.

    tabulate() makes decode one gather and sum from a table of every codebook's vectors already through its
    projection (the projection is linear, so the sum of projected vectors is the projection of the sum, up to
    rounding): the reference path is ~4 kernels per codebook, ~66 of a codec call's small launches, where the
    table's is 2. The engine turns it on; the model's own decode stays the official order of operations."""

    def __init__(self, config: CodecDecoderConfig):
        super().__init__()
        dim = config.codebook_dim // 2
        self.rvq_first = ResidualVectorQuantizer(1, config.codebook_size, dim, config.codebook_dim)
        self.rvq_rest = ResidualVectorQuantizer(config.num_quantizers - 1, config.codebook_size, dim, config.codebook_dim)
        self.tabulated = False
        self._table: tuple[tuple, torch.Tensor, torch.Tensor] | None = None  # (stamp, table, each codebook's offset)

    def tabulate(self) -> None:
        self.tabulated = True

    def decode(self, codes_btq: torch.Tensor) -> torch.Tensor:
        if self.tabulated:
            table, offsets_q = self.table()
            b, t, q = codes_btq.shape
            summed = F.embedding_bag((codes_btq + offsets_q).view(b * t, q), table, mode="sum")
            return summed.view(b, t, -1).transpose(1, 2)
        return self.rvq_first.decode(codes_btq[:, :, :1]) + self.rvq_rest.decode(codes_btq[:, :, 1:])

    @property
    def table_bytes(self) -> int:
        """The table's memory as last built (0 before its first decode): reading it builds nothing."""
        return 0 if self._table is None else self._table[1].numel() * self._table[1].element_size()

    @torch.no_grad()
    def table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(Q * codebook_size, codebook_dim) projected vectors, codebook q's from row q * codebook_size, and those
        offsets (Q,); computed once for the weights as they are (loaded or drawn in place, or moved: a new stamp).
        Built before a CUDA graph is captured (warm-up's eager call), so graphs read a table that stays put."""
        params = [p for rvq in (self.rvq_first, self.rvq_rest)
                  for p in (rvq.output_proj.weight, *rvq.vq.parameters())]
        stamp = weights_stamp(params)
        if self._table is None or self._table[0] != stamp:
            parts = [F.linear(holder._codebook.vectors(), rvq.output_proj.weight[:, :, 0])
                     for rvq in (self.rvq_first, self.rvq_rest) for holder in rvq.vq.layers]
            offsets = torch.arange(len(parts), device=parts[0].device) * parts[0].shape[0]
            self._table = (stamp, torch.cat(parts), offsets)
        return self._table[1], self._table[2]


# --- transformer ------------------------------------------------------------------------------------------------


def scaled_residual_reference(x: torch.Tensor, scale: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + scale * y, the product rounded to its dtype before the sum (the official order)."""
    return x + scale * y


class LayerScale(nn.Module):
    """Adds its sublayer's output, scaled per channel, to the residual; `kernel` computes it:
    scaled_residual_reference, or a fused kernel the engine installs (serving/engine/triton_codec_transformer.py)."""

    kernel = staticmethod(scaled_residual_reference)

    def __init__(self, dim: int, initial_scale: float):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), initial_scale))

    def forward(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + scale * x."""
        return self.kernel(residual, self.scale, x)


def rope_tables(num_positions: int, head_dim: int, theta: float, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-half RoPE cos/sin for positions 0..num_positions-1, as transformers' default rotary embedding."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    freqs_tk = torch.outer(torch.arange(num_positions, device=device, dtype=torch.float32), inv_freq)
    emb_tk = torch.cat((freqs_tk, freqs_tk), dim=-1)
    return emb_tk.cos().to(dtype), emb_tk.sin().to(dtype)


class TransformerNorm(RMSNorm):
    """The transformer's RMSNorm; `kernel` computes it: layers.rms_norm, or a fused kernel the engine installs
    (serving/engine/triton_codec_transformer.py)."""

    kernel = staticmethod(rms_norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.eps)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Split-half RoPE of x (..., T, head_dim) at the T positions of cos/sin (T, head_dim)."""
    return x * cos + rotate_half(x) * sin


class Attention(FusedProjections):
    """q, k and v in one matmul (layers.FusedProjections; a codec call's products are launches, not bandwidth).
    `rope` applies the rotary: rope_reference, or a fused kernel the engine installs."""

    rope = staticmethod(rope_reference)
    fused_names = ("q_proj", "k_proj", "v_proj")

    def __init__(self, config: CodecDecoderConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = SlicedLinear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = SlicedLinear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = SlicedLinear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.fuse()

    def forward(self, x_btc: torch.Tensor, frames: Frames, cos_mk: torch.Tensor, sin_mk: torch.Tensor,
                allowed_b1tm: torch.Tensor) -> torch.Tensor:
        """cos/sin (M, head_dim) for the M = past_frames + T keys; the queries are the last T of them."""
        b, t, _ = x_btc.shape
        qkv = self.product(x_btc)
        q_width = self.num_heads * self.head_dim
        q = qkv[..., :q_width].view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        # keys and values side by side, so a stream's carried ones join this call's in one concatenation
        kv = qkv[..., q_width:].view(b, t, 2, self.num_kv_heads, self.head_dim).permute(0, 2, 3, 1, 4)
        k, v = frames.keys_values(self, kv)
        q = self.rope(q, cos_mk[-t:], sin_mk[-t:])
        k = self.rope(k, cos_mk, sin_mk)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_b1tm,
                                             enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class TransformerLayer(nn.Module):
    def __init__(self, config: CodecDecoderConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = TransformerNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = TransformerNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(config.hidden_size, config.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(config.hidden_size, config.layer_scale_initial_scale)

    def forward(self, x, frames, cos_mk, sin_mk, allowed_b1tm):
        x = self.self_attn_layer_scale(x, self.self_attn(self.input_layernorm(x), frames, cos_mk, sin_mk,
                                                         allowed_b1tm))
        return self.mlp_layer_scale(x, self.mlp(self.post_attention_layernorm(x)))


class Transformer(nn.Module):
    """latent (1024) -> hidden (512) -> layers with a causal sliding window -> norm -> latent."""

    def __init__(self, config: CodecDecoderConfig):
        super().__init__()
        self.config = config
        self.input_proj = nn.Linear(config.latent_dim, config.hidden_size)
        self.layers = nn.ModuleList([TransformerLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = TransformerNorm(config.hidden_size, config.rms_norm_eps)
        self.output_proj = nn.Linear(config.hidden_size, config.latent_dim)

    def forward(self, x_btc: torch.Tensor, frames: Frames) -> torch.Tensor:
        """RoPE positions count from the first key this call sees (frame 0 one-shot, the oldest carried frame
        when streaming): scores depend only on query-key distances, so this equals absolute positions and keeps
        the angles small however long a stream runs. cos/sin are computed in fp32 each call (a few hundred values)."""
        t = x_btc.shape[1]
        h = self.input_proj(x_btc)
        cos_mk, sin_mk = rope_tables(frames.past_frames + t, self.config.head_dim, self.config.rope_theta,
                                     h.device, h.dtype)
        allowed = frames.attention_mask(t, self.config.sliding_window, h.device)
        for layer in self.layers:
            h = layer(h, frames, cos_mk, sin_mk, allowed)
        return self.output_proj(self.norm(h))


# --- the decoder -------------------------------------------------------------------------------------------------


class CodecDecoder(nn.Module):
    def __init__(self, config: CodecDecoderConfig):
        super().__init__()
        self.config = config
        self.samples_per_frame = config.total_upsample
        self.pre_transformer = Transformer(config)
        self.quantizer = SplitResidualVectorQuantizer(config)
        self.pre_conv = CausalConv1d(config.codebook_dim, config.latent_dim, kernel_size=3)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalConvTranspose1d(config.latent_dim, config.latent_dim, r, r),
                           ConvNeXtBlock(config.latent_dim)])
            for r in config.upsampling_ratios
        )
        dims = [config.decoder_dim // 2 ** i for i in range(len(config.upsample_rates) + 1)]
        self.decoder = nn.ModuleList(
            [CausalConv1d(config.latent_dim, config.decoder_dim, 7)]
            + [DecoderBlock(dims[i], dims[i + 1], r) for i, r in enumerate(config.upsample_rates)]
            + [SnakeBeta(dims[-1]), CausalConv1d(dims[-1], 1, 7)]
        )

    @property
    def receptive_field_frames(self) -> int:
        """An upper bound on how many earlier frames can influence a frame's samples (580 for the released
        codec, 8 x 71 of them through the transformer). A chunk decoded with at least this much left context (or all earlier
        frames) equals the one-shot decode; the usual 72-frame context is an approximation for deeper layers."""
        cfg = self.config
        return self.vocoder_receptive_frames + cfg.num_hidden_layers * (cfg.sliding_window - 1) + 2  # pre_conv, k3

    @property
    def vocoder_receptive_frames(self) -> int:
        """An upper bound on how many earlier frames of latents (the transformer's output) can influence a frame's
        samples through the convolutions after it (10 for the released codec)."""
        cfg = self.config
        span = 6  # final conv, kernel 7, at the sample rate
        for rate in reversed(cfg.upsample_rates):
            span += 6 * (1 + 3 + 9)  # residual units: kernel 7, dilations 1, 3, 9
            span = math.ceil(span / rate) + 1  # transposed conv, kernel 2r over stride r, reaches one input back
        span += 6  # decoder[0], kernel 7
        for ratio in reversed(cfg.upsampling_ratios):
            span += 6  # ConvNeXt depthwise conv, kernel 7
            span = math.ceil(span / ratio)  # transposed conv, kernel = stride
        return span

    def forward(self, codes_btq: torch.Tensor, left_pad_b: torch.Tensor | None = None) -> torch.Tensor:
        """codes (B, T, num_quantizers) int64 in [0, codebook_size) -> waveform (B, T * samples_per_frame).

        left_pad_b (B,) int: leading frames of each row that are padding (None: no padding). The samples of
        padded frames are meaningless; the others equal those of the row decoded alone without its padding.
        """
        t = codes_btq.shape[1]
        keep_bt = None
        if left_pad_b is not None:
            keep_bt = torch.arange(t, device=codes_btq.device)[None, :] >= left_pad_b.to(codes_btq.device)[:, None]
        return self.run(codes_btq, Frames(keep_bt))

    def run(self, codes_btq: torch.Tensor, frames: Frames) -> torch.Tensor:
        """The architecture, once: codes (B, T, Q) -> waveform (B, T * samples_per_frame), with what precedes
        the T frames given by `frames` (one-shot: nothing; codec_stream: each row's carried state)."""
        return self.vocode(self.latents(codes_btq, frames), frames)

    def latents(self, codes_btq: torch.Tensor, frames: Frames) -> torch.Tensor:
        """The first half: codes (B, T, Q) -> latents (B, latent_dim, T), the transformer's output."""
        h = self.quantizer.decode(codes_btq)                                   # (B, codebook_dim, T)
        h = self.pre_conv(h, frames).transpose(1, 2)                            # (B, T, latent)
        return self.pre_transformer(h, frames).transpose(1, 2)                  # (B, latent, T)

    def vocode(self, h: torch.Tensor, frames: Frames) -> torch.Tensor:
        """The second half, where nearly all the work is: latents (B, latent_dim, T) -> waveform."""
        frames = frames.vocoding()
        for trans_conv, convnext in self.upsample:
            h = trans_conv(h, frames)
            frames = frames.upsampled(trans_conv.conv.stride[0])
            h = convnext(h, frames)
        h = self.decoder[0](h, frames)
        for block in self.decoder[1:-2]:
            h = block(h, frames)
            frames = frames.upsampled(block.rate)
        wav = self.decoder[-1](h, frames, act=self.decoder[-2])
        return wav.clamp(min=-1, max=1)[:, 0, :]

    def decode_chunk(self, codes_btq: torch.Tensor, context_frames: int | torch.Tensor) -> torch.Tensor:
        """Stateless streaming step: re-decode earlier frames as context, return only the new samples.

        Superseded for serving by codec_stream.IncrementalCodecDecoder, which decodes each frame once and is
        exact; this remains for `decode` (the official offline windows).

        codes (B, T, Q): each row is [left padding | context frames | new frames], all rows with the same number
        of new frames N = T - max(context). context_frames: int (same for all rows) or (B,) ints <= T.
        Returns (B, N * samples_per_frame). Decoding with all earlier frames as context gives exactly the
        one-shot samples, and so does any context >= receptive_field_frames; a shorter one (e.g. the usual 72
        frames) truncates the history that the deeper transformer layers see, an approximation.
        """
        b, t, _ = codes_btq.shape
        if isinstance(context_frames, int):
            left_pad_b = None
            max_context = context_frames
        else:
            context_b = context_frames.to(device=codes_btq.device, dtype=torch.long)
            max_context = int(context_b.max())
            left_pad_b = max_context - context_b
        if not 0 <= max_context < t:
            raise ValueError(f"context of {max_context} frames leaves no new frames in a chunk of {t}")
        wav = self.forward(codes_btq, left_pad_b)
        return wav[:, max_context * self.samples_per_frame:]

    def check_codes(self, codes_btq: torch.Tensor) -> None:
        """Clear errors for codes the tables cannot hold (on CUDA an out-of-range index is a device assert)."""
        if codes_btq.dim() != 3 or codes_btq.shape[-1] != self.config.num_quantizers:
            raise ValueError(f"codes must be (batch, frames, {self.config.num_quantizers}), got {tuple(codes_btq.shape)}")
        if codes_btq.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"codes must be integers, got {codes_btq.dtype}")
        if codes_btq.numel() and (int(codes_btq.min()) < 0 or int(codes_btq.max()) >= self.config.codebook_size):
            raise ValueError(f"codes must lie in [0, {self.config.codebook_size}), got "
                             f"[{int(codes_btq.min())}, {int(codes_btq.max())}]")

    @torch.inference_mode()
    def decode(self, codes_btq: torch.Tensor, lengths_b: list[int] | None = None,
               chunk_frames: int = 300, left_context_frames: int = 25) -> list[torch.Tensor]:
        """Offline decode with the official semantics: windows of 300 frames, each re-decoding the 25 frames
        before it; one window (a plain one-shot decode) for up to 300 frames. Rows may be right-padded:
        lengths_b gives each row's frame count. Returns one 1-D waveform per row, lengths * 1920 samples."""
        self.check_codes(codes_btq)
        b, t, _ = codes_btq.shape
        lengths_b = [t] * b if lengths_b is None else list(lengths_b)
        if len(lengths_b) != b or any(not 0 <= n <= t for n in lengths_b):
            raise ValueError(f"lengths {lengths_b} do not fit codes of shape {tuple(codes_btq.shape)}")
        pieces = []
        for start in range(0, t, chunk_frames):
            end = min(start + chunk_frames, t)
            context = min(left_context_frames, start)
            pieces.append(self.decode_chunk(codes_btq[:, start - context:end], context))
        wav_bs = torch.cat(pieces, dim=1) if pieces else codes_btq.new_zeros((b, 0), dtype=torch.float32)
        return [wav_bs[i, : n * self.samples_per_frame] for i, n in enumerate(lengths_b)]


def chunk_schedule(num_frames: int, first_chunk_frames: int = 4, chunk_frames: int = 25,
                   left_context_frames: int = 72) -> list[tuple[int, int, int]]:
    """Streaming plan over num_frames: (context_start, start, end) per chunk, frames [start, end) new and
    [context_start, start) re-decoded as context. A small first chunk gets the first audio out early."""
    if min(first_chunk_frames, chunk_frames) < 1 or left_context_frames < 0:
        raise ValueError("chunk sizes must be >= 1 and the left context >= 0")
    plan, start = [], 0
    while start < num_frames:
        end = min(start + (first_chunk_frames if start == 0 else chunk_frames), num_frames)
        plan.append((max(0, start - left_context_frames), start, end))
        start = end
    return plan


# --- random weights for test and dummy checkpoints -----------------------------------------------------------------


@torch.no_grad()
def init_random_(decoder: CodecDecoder, generator: torch.Generator) -> None:
    """Fill every tensor with values that make the decoder sensitive to its input: distinct codebook vectors and
    usages, LayerScale / ConvNeXt gamma large enough for each stage to matter, unit-ish activations through
    the residual stacks, and a last conv scaled so the waveform stays mostly inside the clamp."""

    def normal_(p: torch.Tensor, std: float, mean: float = 0.0) -> None:
        p.copy_(torch.randn(p.shape, generator=generator) * std + mean)

    for module in decoder.modules():
        if isinstance(module, (nn.Conv1d, nn.ConvTranspose1d)):
            if isinstance(module, nn.Conv1d):
                fan_in = module.weight[0].numel()
            else:  # transposed, weight (in, out, k): each output sample sums in * k / stride taps
                fan_in = module.weight.shape[0] * module.weight.shape[2] // module.stride[0]
            normal_(module.weight, 1.0 / math.sqrt(fan_in))
            if module.bias is not None:
                normal_(module.bias, 0.02)
        elif isinstance(module, nn.Linear):
            normal_(module.weight, 1.0 / math.sqrt(module.in_features))
            if module.bias is not None:
                normal_(module.bias, 0.02)
        elif isinstance(module, (nn.LayerNorm, RMSNorm)):
            normal_(module.weight, 0.1, mean=1.0)
            if getattr(module, "bias", None) is not None:
                normal_(module.bias, 0.02)
        elif isinstance(module, LayerScale):
            normal_(module.scale, 0.02, mean=0.2)
        elif isinstance(module, ConvNeXtBlock):
            normal_(module.gamma, 0.02, mean=0.2)
        elif isinstance(module, SnakeBeta):
            normal_(module.alpha, 0.1)
            normal_(module.beta, 0.1)
        elif isinstance(module, Codebook):
            normal_(module.embedding_sum, 1.0)
            module.cluster_usage.copy_(0.5 + torch.rand(module.cluster_usage.shape, generator=generator))
    # residual units add onto their input: keep each addition small so activations stay O(1) through 12 units.
    for module in decoder.modules():
        if isinstance(module, ResidualUnit):
            module.conv2.conv.weight.mul_(0.3)
    # scale the last conv so the pre-clamp waveform of random codes has a std of about 0.3
    last = decoder.decoder[-1].conv
    codes = torch.randint(0, decoder.config.codebook_size, (1, 4, decoder.config.num_quantizers), generator=generator)
    captured = {}

    def record_std(_module, _inputs, out):
        captured["std"] = float(out.float().std())

    hook = decoder.decoder[-1].register_forward_hook(record_std)
    try:
        decoder(codes.to(last.weight.device))
    finally:
        hook.remove()
    scale = 0.3 / max(captured["std"], 1e-12)
    last.weight.mul_(scale)
    last.bias.mul_(scale)
