"""Transformer building blocks shared by the talker and the code predictor.

Plain PyTorch with an explicit, preallocated KV cache passed in by the caller, so that the serving engine
can own the cache tensors (slots x heads x positions) and capture fixed-shape steps in CUDA graphs.
RMSNorm and RoPE follow the official operation order in fp32 (a different order flips near-tie argmaxes).
Module and parameter names equal the official checkpoint names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from serving.model.config import TransformerConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(variance + self.eps)
        return self.weight * x32.to(input_dtype)


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


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, write_pos: torch.Tensor, kv_len: int, mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, L, H]; k_cache/v_cache [B, KV, S, D], written in place at write_pos [B, L] (cache position of
        each new token, per row); attends over cache positions [0, kv_len). mask: bool [B, 1, L, kv_len], or
        None for plain causal attention when the new tokens are the last L of kv_len positions in every row."""
        batch, seq, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rows = torch.arange(batch, device=x.device)[:, None]
        k_cache[rows, :, write_pos] = k.transpose(1, 2)
        v_cache[rows, :, write_pos] = v.transpose(1, 2)
        keys, values = k_cache[:, :, :kv_len], v_cache[:, :, :kv_len]
        if mask is None:
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=seq > 1, scale=self.scale, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, k_cache, v_cache, write_pos, kv_len, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, write_pos, kv_len, mask)
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
                kv_len: int, mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, L, H], rope positions [B, L] -> post-norm hidden [B, L, H]; see Attention.forward."""
        cos, sin = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.k[i], cache.v[i], write_pos, kv_len, mask)
        return self.norm(x)
