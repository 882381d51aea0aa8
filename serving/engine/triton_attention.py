"""The talker's decode attention over each row's own cached positions, as one Triton kernel, for CUDA.

A decode step's graph is captured for a KV-length bucket, and SDPA with a mask reads every row's cache up to
that bucket: on an H100 a 128-row step of the 0.6B talker spends ~3.7 us per position of it, HBM-bound
(docs/performance.md). When rows differ in length (a served batch: prompts of 30 to 700 positions, streams at
every stage), the bucket is set by the longest, so most keys read are masked out. Here a program per (row,
key/value head) reads only that row's positions [0, length), a block at a time with an online softmax, and
serves the query heads of its group together (their queries padded to a 16-row tile for tl.dot), so each key
and value is read once. Numerics: scores and the softmax in float32, probabilities rounded to the cache's dtype
for the product with the values (as flash attention does). The scale is a compile-time constant: a float
argument reaches a kernel inside torch.compile as float64, and would widen the softmax's loop variables.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MIN_ROWS = 32  # steps of fewer rows keep SDPA: too few programs to keep HBM busy (16 rows: 4% slower on an H100)
BLOCK = 64  # keys per iteration
_DOT_F32 = os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter's bfloat16 tl.dot is wrong (triton_layers)


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _decode_attention_kernel(q_ptr, sqb, sqh, k_ptr, v_ptr, skb, skh, sks, len_ptr, out_ptr,
                             SCALE: tl.constexpr, HEADS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                             DOT_F32: tl.constexpr):
    """Program (row b, key/value head g): out[b, h] for the GROUP query heads h of g, over keys [0, len[b])."""
    b = tl.program_id(0)
    g = tl.program_id(1)
    qi = tl.arange(0, 16)
    q_ok = qi < GROUP
    heads = g * GROUP + qi
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sqb + heads[:, None] * sqh + d[None, :], mask=q_ok[:, None], other=0.0)
    n = tl.load(len_ptr + b)
    base = b * skb + g * skh
    m = tl.full((16,), float("-inf"), tl.float32)
    total = tl.zeros((16,), tl.float32)
    acc = tl.zeros((16, D), tl.float32)
    start = 0
    while start < n:  # not range(0, n, BLOCK): the interpreter cannot take a loaded bound as a range's
        s = start + tl.arange(0, BLOCK)
        ok = s < n
        k = tl.load(k_ptr + base + s[:, None] * sks + d[None, :], mask=ok[:, None], other=0.0)
        scores = tl.where(ok[None, :], _dot(q, tl.trans(k), DOT_F32) * SCALE, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + base + s[:, None] * sks + d[None, :], mask=ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_F32)
        m = m_new
        start += BLOCK
    out = acc / total[:, None]
    tl.store(out_ptr + (b * HEADS + heads[:, None]) * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=q_ok[:, None])


def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Query groups of at most 16 heads, head_dim a power of two of at least 16 (tl.dot's tile)."""
    group = num_heads // num_kv_heads
    return num_heads % num_kv_heads == 0 and group <= 16 and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                     scale: float) -> torch.Tensor | None:
    """q [B, H, 1, D] (any strides), k_cache/v_cache [B, KV, S, D] (unit stride in D), lengths [B] (keys of each
    row: its query's position + 1) -> [B, H, 1, D]; None for steps of fewer than MIN_ROWS rows (SDPA's)."""
    batch, heads, _, dim = q.shape
    if batch < MIN_ROWS:
        return None
    kv_heads = k_cache.shape[1]
    out = torch.empty((batch, heads, 1, dim), dtype=q.dtype, device=q.device)
    _decode_attention_kernel[(batch, kv_heads)](
        q, q.stride(0), q.stride(1), k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        lengths, out, SCALE=scale, HEADS=heads, GROUP=heads // kv_heads, D=dim, BLOCK=BLOCK, DOT_F32=_DOT_F32,
        num_warps=4, num_stages=3)
    return out
