"""Transformer building blocks shared by the talker and the code predictor.

Plain PyTorch with an explicit, preallocated KV cache passed in by the caller, so that the serving engine
can own the cache tensors (slots x heads x positions) and capture fixed-shape steps in CUDA graphs.
RMSNorm and RoPE follow the official operation order in fp32 (a different order flips near-tie argmaxes).
Module and parameter names equal the official checkpoint names; q/k/v and gate/up nonetheless run as one
matmul each over a fused weight whose rows those parameters view (FusedProjections).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from serving.model.config import TransformerConfig

# Causal passes over several new positions (prefills) skip cuDNN's attention: it builds an execution plan for
# every new (rows, length) shape, 50-100 ms each on an H100, and a server's prompt bursts come in every shape
# (docs/performance.md, eighth pass). Flash attention has no per-shape setup.
MULTI_TOKEN_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: normalised in fp32, rounded to x's dtype, then scaled by weight."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class RotaryTable(nn.Module):
    """cos/sin for positions 0..max_positions-1, computed in fp32 like the official rotary embedding.

    Split-half (rotate_half) RoPE. The talker's multimodal RoPE reduces to this because its three
    position rows are identical for speech.
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int):
        super().__init__()
        self.head_dim, self.theta, self.max_positions = head_dim, theta, max_positions
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.rebuild_buffers()

    def rebuild_buffers(self) -> None:
        """(Re)compute the tables in fp32 on the current device (also after building on the meta device)."""
        device = self.cos.device
        if device.type == "meta":
            return
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float()
                                         / self.head_dim))
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, L] (long) -> cos, sin [B, 1, L, head_dim] in dtype, ready to broadcast over heads."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return (x * cos) + (rotate_half(x) * sin)


def attention_mask(query_cache_pos: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
    """Boolean SDPA mask [B, 1, Lq, S]: query at cache position p sees valid keys at positions <= p.

    query_cache_pos [B, Lq] (long), key_valid [B, S] (bool; False for left padding and unused slots).
    A query always sees itself, so padded query rows stay finite (their outputs are never used).
    """
    key_pos = torch.arange(key_valid.shape[1], device=key_valid.device)
    causal = key_pos[None, None, :] <= query_cache_pos[:, :, None]
    allowed = (causal & key_valid[:, None, :]) | (key_pos[None, None, :] == query_cache_pos[:, :, None])
    return allowed[:, None]


class KVCache:
    """Preallocated keys and values of every layer: k, v [layers, batch, kv_heads, max_len, head_dim]."""

    def __init__(self, num_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, batch, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @classmethod
    def for_stack(cls, cfg: TransformerConfig, batch: int, max_len: int, dtype, device) -> "KVCache":
        return cls(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim, dtype, device)

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


class SlicedLinear(nn.Linear):
    """An official-name projection whose weight (and bias) are views of rows of its owner's fused tensors.

    Converting it on its own or assigning it new tensors would cut it loose from the fused tensors the owner's
    matmul reads (stale weights, silently), so both raise; convert the owner or any module above it instead.
    In-place writes (loading, copy_) go through the views into the fused tensors. Its forward still works."""

    sliced = False  # set by the owner once the views exist
    owner_converting = False  # the owner's _apply is running: converting is allowed, the owner re-fuses after

    def __setattr__(self, name, value):
        if name in ("weight", "bias") and self.sliced:
            raise AttributeError(f"cannot assign {name} of a projection that views its owner's fused tensor; "
                                 f"copy into it in place instead (load_state_dict without assign=True)")
        super().__setattr__(name, value)

    def _apply(self, fn, recurse=True):
        if self.sliced and not self.owner_converting:
            raise RuntimeError("this projection's tensors are views of its owner's fused tensor: convert the "
                               "owning Attention/MLP (or the whole model) instead of the projection alone")
        return super()._apply(fn, recurse)


def _fuse_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate parts along dim 0 into a new tensor and make each part (a Parameter) a view of its rows."""
    fused = torch.cat([t.detach() for t in parts])
    offset = 0
    for t in parts:
        t.data = fused[offset: offset + t.shape[0]]
        offset += t.shape[0]
    return fused


def _are_rows_of(parts: list[torch.Tensor], fused: torch.Tensor | None) -> bool:
    """parts are, in order, views of all the rows of fused (meta tensors have no addresses to compare)."""
    if fused is None or fused.device.type == "meta":
        return False
    offset = 0
    for t in parts:
        rows = fused[offset: offset + t.shape[0]]
        if (t.dtype, t.device, t.shape, t.stride(), t.data_ptr()) != (
                rows.dtype, rows.device, rows.shape, rows.stride(), rows.data_ptr()):
            return False
        offset += t.shape[0]
    return offset == fused.shape[0]


class FusedProjections(nn.Module):
    """Base of Attention and MLP: projections of the same input, kept under their official names (loading,
    state_dict, checkpoint writing are unchanged), run as ONE matmul over a fused weight.

    Why: a decode step is a row or a few, so each projection is a small GEMV whose launch, not the memory
    traffic, sets its time; one matmul over the stacked weight does q, k, v (or gate, up) in one launch.
    The fused tensors own the storage and the official parameters are views of their rows, so the weights
    exist once and in-place loads reach the matmul. Module._apply (.to, .half, .cuda, to_empty) replaces
    each parameter's data separately, which cuts the views, so _apply re-fuses from the official
    parameters (the source of truth) afterwards; converting or reassigning a projection alone raises
    (SlicedLinear), and deepcopy/unpickling re-fuses too. The fused tensors are plain attributes: not in
    state_dict, parameters() or buffers(). Inference only: gradients do not reach the official parameters."""

    fused_names: tuple[str, ...] = ()
    fused_weight: torch.Tensor | None = None
    fused_bias: torch.Tensor | None = None

    @torch.no_grad()
    def fuse(self) -> None:
        """(Re)build the fused weight/bias from the official parameters and point those at its rows; a no-op
        where they already are views of the current fused tensors (a .to() that changes nothing)."""
        parts = [getattr(self, name) for name in self.fused_names]
        weights = [p.weight for p in parts]
        if not _are_rows_of(weights, self.fused_weight):
            self.fused_weight = _fuse_rows(weights)
        biases = [p.bias for p in parts]
        if biases[0] is None:
            self.fused_bias = None
        elif not _are_rows_of(biases, self.fused_bias):
            self.fused_bias = _fuse_rows(biases)
        self.fused_sizes = [p.out_features for p in parts]
        for p in parts:
            p.sliced = True

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """One matmul for all fused projections: their outputs side by side, in fused_names order."""
        return F.linear(x, self.fused_weight, self.fused_bias)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """product(x) split into the projections' outputs."""
        return self.product(x).split(self.fused_sizes, dim=-1)

    def _apply(self, fn, recurse=True):
        parts = [getattr(self, name) for name in self.fused_names]
        for p in parts:
            p.owner_converting = True
        try:
            super()._apply(fn, recurse)
        finally:
            for p in parts:
                p.owner_converting = False
        self.fuse()
        return self

    def __setattr__(self, name, value):
        if name in self.fused_names and name in self._modules:
            raise AttributeError(f"cannot replace {name}: its tensors are views of the fused projection weight")
        super().__setattr__(name, value)

    def __setstate__(self, state):
        """deepcopy and unpickling copy each parameter on its own: re-fuse the copies."""
        super().__setstate__(state)
        self.fuse()


class Attention(FusedProjections):
    fused_names = ("q_proj", "k_proj", "v_proj")

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = SlicedLinear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = SlicedLinear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = SlicedLinear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim ** -0.5
        self.fuse()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, write_pos: torch.Tensor, kv_len: int, mask: torch.Tensor | None,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, L, H]; k_cache/v_cache [S, KV, P, D], written in place at write_pos [B, L] (cache position of
        each new token, per row) of cache rows `rows` [B, 1] (None: row i of x is cache row i); attends over
        cache positions [0, kv_len). mask: bool [B, 1, L, kv_len], or None for plain causal attention when the
        new tokens are the last L of kv_len positions in every row. With several new tokens and no mask, the
        pass starts at position 0 (kv_len = L: a prefill), so the new keys are all the keys: it attends over
        them as computed, and any cache rows may take them (a burst's prefill writes straight into its slots)."""
        batch, seq, _ = x.shape
        q, k, v = self.project(x)
        q = self.q_norm(q.view(batch, seq, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(batch, seq, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = v.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if rows is None:
            rows = torch.arange(batch, device=x.device)[:, None]
        k_cache[rows, :, write_pos] = k.transpose(1, 2)
        v_cache[rows, :, write_pos] = v.transpose(1, 2)
        if mask is not None:
            out = F.scaled_dot_product_attention(q, k_cache[:, :, :kv_len], v_cache[:, :, :kv_len], attn_mask=mask,
                                                 scale=self.scale, enable_gqa=True)
        elif seq > 1:  # a branch, not is_causal=seq > 1: compiled with dynamic shapes that is a SymBool, a graph break
            with sdpa_kernel(MULTI_TOKEN_SDPA):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, k_cache[:, :, :kv_len], v_cache[:, :, :kv_len], scale=self.scale,
                                                 enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


class MLP(FusedProjections):
    """SwiGLU; gate and up in one matmul."""

    fused_names = ("gate_proj", "up_proj")

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = SlicedLinear(hidden, intermediate, bias=False)
        self.up_proj = SlicedLinear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.fuse()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.project(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, k_cache, v_cache, write_pos, kv_len, mask, rows=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, write_pos, kv_len, mask, rows)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """Layers + final norm over an explicit KV cache. Submodule names: layers.N.*, norm."""

    def __init__(self, cfg: TransformerConfig, max_positions: int):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryTable(cfg.head_dim, cfg.rope_theta, max_positions)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, write_pos: torch.Tensor,
                kv_len: int, mask: torch.Tensor | None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, L, H], rope positions [B, L] -> post-norm hidden [B, L, H]; see Attention.forward."""
        cos, sin = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.k[i], cache.v[i], write_pos, kv_len, mask, rows)
        return self.norm(x)
