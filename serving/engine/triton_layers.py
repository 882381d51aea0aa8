"""Decoder layers for a few rows, as five Triton kernels per layer, for CUDA: the code predictor's and the talker's.

A frame runs the code predictor's 5 layers 15 times, one or two positions per row, and the talker's 28 layers
once. At batch 1 on an H100 such a layer was ~13 kernels: four cuBLAS GEMVs (plus split-K reductions) and ~9
small fused kernels (norms, q/k norm and rotary, cache writes, attention, SiLU, residual additions) of 1-1.5 us
each, with a launch gap between any two; the small ones and the gaps were ~40% of a 5 ms frame
(docs/performance.md). Here a layer is:

1. input norm + q/k/v projection (the norm in the same pass over the input, the fused weight of layers.py),
2. q/k norm + rotary + cache write + attention: over up to MAX_KEYS cached positions one program per row and
   query head holds them all (the code predictor's 16); over a longer cache (the talker's) the cache is cut
   into MAX_KEYS-key blocks, one program per row, query head and block for the row's one new position, and a
   second kernel merges the blocks' softmax parts (split-key decoding),
3. output projection + residual addition,
4. post-attention norm + gate/up projection + SiLU(gate) * up,
5. down projection + residual addition,

and the code predictor's final norm rides with each head's projection. The matrix products are tl.dot over
16-row tiles (rows beyond the call's are masked), so a call takes at most MAX_ROWS rows (batch x positions);
calls of up to GEMV_ROWS rows multiply element by element instead, which keeps more loads in flight.
Values are rounded to the model's dtype wherever the torch modules hand a tensor on (projections, q/k norms,
rotary, residual sums), and computed in float32 in between; an input norm's 1 / RMS, a per-row factor, scales the
product's sums rather than the norm's output, which is therefore not rounded on its own (bfloat16 noise: the
logits stay within ~3% (code predictor) and ~6% (talker) of their spread of the modules', docs/performance.md).
The modules in serving.model.layers stay the definition of the maths and the path of every other call; tests run
these kernels in Triton's interpreter against them.

Steps of more rows (WideStack) keep torch's products (cuBLAS outruns tl.dot there) but still take kernel 2 as one
launch: the modules spend ~5 kernels on q/k norms, rotary and the two cache writes, plus SDPA, 75 times a frame
in the code predictor and 28 in the talker. The talker's kernel 2 there (row_attention) reads each row's own
positions only, a program per row and key/value head: a served batch holds prompts of 30 to 700 positions and
streams at every stage, and SDPA over a KV bucket reads every row up to the longest. A wide talker step can carry new
prompts' positions as rows of its own (Prompts): the same products, and row_attention with a slot per row.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from serving.model.layers import DecoderStack, rms_norm

MAX_ROWS = 16  # rows (batch x positions) of one call: the matrix products' tile height
MAX_KEYS = 64  # cached positions one attention program holds at once (the code predictor's cache: 16)
# Triton's CPU interpreter multiplies bfloat16 tiles wrongly in tl.dot (3.6: raw bits), so there the products
# take float32 copies of the same values (DOT_F32): a bfloat16 product is exact in float32, the sums are float32
# either way
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_DOT_F32 = _INTERPRET
# Programmatic dependent launch (CUDA, compute capability 9+) for calls of up to PDL_ROWS rows: a kernel's
# programs are launched while the previous kernel finishes and wait for it (gdc_wait) before reading anything.
# At 1-2 rows the code predictor's passes gain ~5%; at 4-8 rows the waiting programs slowed the running ones
# (docs/performance.md). False: plain launches (benchmarks/decode_bench.py compile-pdl-off).
PDL = True
PDL_ROWS = 2


@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    """Under programmatic dependent launch: wait for the previous kernel, then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _accumulate(acc, a, w, DOT: tl.constexpr, DOT_F32: tl.constexpr):
    """acc [M, N] + a [M, K] @ w [N, K]^T in float32: by tl.dot (DOT), else by multiply-adds per element."""
    if DOT:
        if DOT_F32:
            acc = tl.dot(a.to(tl.float32), tl.trans(w).to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
    else:
        acc += tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    return acc


@triton.jit
def _norm_matmul_kernel(x_ptr, sxm, norm_ptr, w_ptr, out_ptr, M, K: tl.constexpr, N, eps, GATED: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
                        DOT_F32: tl.constexpr, PDL: tl.constexpr):
    """out[:, n] = RMSNorm(x) @ w[n]^T; GATED: w holds gate rows [0, N) then up rows [N, 2N) and
    out = SiLU(gate) * up. The rows' 1 / RMS is a per-row factor of the product, so it is summed in the same
    pass over x and applied to the sums (no prologue pass, whose loads would wait one after another).
    DOT: the products by tl.dot (16-row tiles); else as float32 multiply-adds per element (a few rows: no tile
    of 16 rows through shared memory). PDL: _pdl_wait."""
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    _pdl_wait(PDL)
    dt = out_ptr.dtype.element_ty
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_ptr + rows[:, None] * sxm + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        sq += tl.sum(x * x, axis=1)
        a = (x * tl.load(norm_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]).to(dt)
        at = cols[:, None] * K + k[None, :]
        ok = col_ok[:, None] & k_ok[None, :]
        acc = _accumulate(acc, a, tl.load(w_ptr + at, mask=ok, other=0.0).to(dt), DOT, DOT_F32)
        if GATED:
            acc_up = _accumulate(acc_up, a, tl.load(w_ptr + N * K + at, mask=ok, other=0.0).to(dt), DOT, DOT_F32)
    rstd = tl.rsqrt(sq / K + eps)[:, None]
    out = (acc * rstd).to(dt)
    if GATED:
        gate = out.to(tl.float32)
        out = ((gate * tl.sigmoid(gate)).to(dt).to(tl.float32) * (acc_up * rstd).to(dt).to(tl.float32)).to(dt)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], out, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _matmul_residual_kernel(x_ptr, w_ptr, res_ptr, out_ptr, M, K: tl.constexpr, N,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
                            DOT_F32: tl.constexpr, PDL: tl.constexpr):
    """out = res + x @ w^T (the product rounded to the model dtype first, as a module's output is); DOT and PDL
    as in _norm_matmul_kernel."""
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    _pdl_wait(PDL)
    dt = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(dt)
        w = tl.load(w_ptr + cols[:, None] * K + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(dt)
        acc = _accumulate(acc, x, w, DOT, DOT_F32)
    ok = row_ok[:, None] & col_ok[None, :]
    res = tl.load(res_ptr + rows[:, None] * N + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], (acc.to(dt).to(tl.float32) + res).to(dt), mask=ok)


@triton.jit
def _head_norm_rope(lo, hi, norm_ptr, cos_ptr, sin_ptr, pos, eps, dt, HALF: tl.constexpr):
    """One head's halves after layers.RMSNorm (over the head) and split-half rotary at `pos`."""
    d = tl.arange(0, HALF)
    rstd = tl.rsqrt((tl.sum(lo * lo, axis=0) + tl.sum(hi * hi, axis=0)) / (2 * HALF) + eps)
    lo = ((lo * rstd).to(dt).to(tl.float32) * tl.load(norm_ptr + d).to(tl.float32)).to(dt).to(tl.float32)
    hi = ((hi * rstd).to(dt).to(tl.float32) * tl.load(norm_ptr + HALF + d).to(tl.float32)).to(dt).to(tl.float32)
    c_lo = tl.load(cos_ptr + pos * 2 * HALF + d).to(dt).to(tl.float32)
    c_hi = tl.load(cos_ptr + pos * 2 * HALF + HALF + d).to(dt).to(tl.float32)
    s_lo = tl.load(sin_ptr + pos * 2 * HALF + d).to(dt).to(tl.float32)
    s_hi = tl.load(sin_ptr + pos * 2 * HALF + HALF + d).to(dt).to(tl.float32)
    out_lo = ((lo * c_lo).to(dt).to(tl.float32) + (-hi * s_lo).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    out_hi = ((hi * c_hi).to(dt).to(tl.float32) + (lo * s_hi).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    return out_lo, out_hi


@triton.jit
def _attention_kernel(qkv_ptr, qn_ptr, kn_ptr, eps, cos_ptr, sin_ptr, pos_ptr, spb, spl,
                      k_ptr, v_ptr, scb, sch, scs, out_ptr, scale, L: tl.constexpr,
                      HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, KEYS: tl.constexpr,
                      HEADS_PER: tl.constexpr, PDL: tl.constexpr):
    """Program (row b, query heads h0 .. h0 + HEADS_PER - 1 of one key/value head): normalises and rotates the
    keys of the row's L new positions (the group's first program caches them and the values), then each new
    position of each of its heads attends to the positions up to its own. All loads are issued up front: the
    cached positions come from the cache and the new ones from registers, so no load waits for a store.
    HEADS_PER divides the group: 1 gives the most programs (few rows), the group reads its keys once (many)."""
    _pdl_wait(PDL)
    b = tl.program_id(0)
    h0 = tl.program_id(1) * HEADS_PER
    D: tl.constexpr = 2 * HALF
    GROUP: tl.constexpr = HEADS // KV_HEADS
    g = h0 // GROUP
    width = (HEADS + 2 * KV_HEADS) * D
    dt = k_ptr.dtype.element_ty
    d = tl.arange(0, HALF)
    s = tl.arange(0, KEYS)
    cache = b * scb + g * sch
    at = cache + s[:, None] * scs + d[None, :]
    last = tl.load(pos_ptr + b * spb + (L - 1) * spl)
    known = s[:, None] <= last
    k_lo = tl.load(k_ptr + at, mask=known, other=0.0).to(tl.float32)
    k_hi = tl.load(k_ptr + at + HALF, mask=known, other=0.0).to(tl.float32)
    v_lo = tl.load(v_ptr + at, mask=known, other=0.0).to(tl.float32)
    v_hi = tl.load(v_ptr + at + HALF, mask=known, other=0.0).to(tl.float32)
    for t in tl.static_range(L):
        src = qkv_ptr + (b * L + t) * width
        pos = tl.load(pos_ptr + b * spb + t * spl)
        new_lo = tl.load(src + (HEADS + g) * D + d).to(tl.float32)
        new_hi = tl.load(src + (HEADS + g) * D + HALF + d).to(tl.float32)
        new_lo, new_hi = _head_norm_rope(new_lo, new_hi, kn_ptr, cos_ptr, sin_ptr, pos, eps, dt, HALF)
        val_lo = tl.load(src + (HEADS + KV_HEADS + g) * D + d).to(tl.float32)
        val_hi = tl.load(src + (HEADS + KV_HEADS + g) * D + HALF + d).to(tl.float32)
        here = (s == pos)[:, None]
        k_lo = tl.where(here, new_lo[None, :], k_lo)
        k_hi = tl.where(here, new_hi[None, :], k_hi)
        v_lo = tl.where(here, val_lo[None, :], v_lo)
        v_hi = tl.where(here, val_hi[None, :], v_hi)
        if h0 % GROUP == 0:
            tl.store(k_ptr + cache + pos * scs + d, new_lo.to(dt))
            tl.store(k_ptr + cache + pos * scs + HALF + d, new_hi.to(dt))
            tl.store(v_ptr + cache + pos * scs + d, val_lo.to(dt))
            tl.store(v_ptr + cache + pos * scs + HALF + d, val_hi.to(dt))
    for t in tl.static_range(L):
        src = qkv_ptr + (b * L + t) * width
        pos = tl.load(pos_ptr + b * spb + t * spl)
        seen = s <= pos
        for j in tl.static_range(HEADS_PER):
            h = h0 + j
            q_lo = tl.load(src + h * D + d).to(tl.float32)
            q_hi = tl.load(src + h * D + HALF + d).to(tl.float32)
            q_lo, q_hi = _head_norm_rope(q_lo, q_hi, qn_ptr, cos_ptr, sin_ptr, pos, eps, dt, HALF)
            score = (tl.sum(k_lo * q_lo[None, :], axis=1) + tl.sum(k_hi * q_hi[None, :], axis=1)) * scale
            score = tl.where(seen, score, float("-inf"))
            p = tl.exp(score - tl.max(score, axis=0))
            p = p / tl.sum(p, axis=0)
            dst = out_ptr + (b * L + t) * HEADS * D + h * D
            tl.store(dst + d, tl.sum(p[:, None] * v_lo, axis=0).to(dt))
            tl.store(dst + HALF + d, tl.sum(p[:, None] * v_hi, axis=0).to(dt))


@triton.jit
def _split_attention_kernel(qkv_ptr, qn_ptr, kn_ptr, eps, cos_ptr, sin_ptr, pos_ptr, spb,
                            k_ptr, v_ptr, scb, sch, scs, part_ptr, scale, SPLITS: tl.constexpr,
                            HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, CHUNK: tl.constexpr,
                            PDL: tl.constexpr):
    """_attention_kernel for one new position per row over a cache of any length (the talker's), split over
    keys: program (row b, query head h, split c) attends to the row's cached positions [c CHUNK, (c + 1) CHUNK)
    below its new one, and split 0 to the new key and value too, from registers (normalised and rotated; the
    group's first query head caches them), so no load waits for a store. Each writes its softmax's max, sum
    and unnormalised output (float32) to part [B, H, SPLITS, 2 + 2 HALF]; _combine_kernel merges the row's live
    splits (those below its position, and split 0). Splits past the row's position load nothing."""
    _pdl_wait(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    D: tl.constexpr = 2 * HALF
    GROUP: tl.constexpr = HEADS // KV_HEADS
    g = h // GROUP
    dt = k_ptr.dtype.element_ty
    d = tl.arange(0, HALF)
    cache = b * scb + g * sch
    pos = tl.load(pos_ptr + b * spb)
    src = qkv_ptr + b * (HEADS + 2 * KV_HEADS) * D
    q_lo = tl.load(src + h * D + d).to(tl.float32)
    q_hi = tl.load(src + h * D + HALF + d).to(tl.float32)
    q_lo, q_hi = _head_norm_rope(q_lo, q_hi, qn_ptr, cos_ptr, sin_ptr, pos, eps, dt, HALF)
    s = c * CHUNK + tl.arange(0, CHUNK)
    ok = s < pos
    at = cache + s[:, None] * scs + d[None, :]
    k_lo = tl.load(k_ptr + at, mask=ok[:, None], other=0.0).to(tl.float32)
    k_hi = tl.load(k_ptr + at + HALF, mask=ok[:, None], other=0.0).to(tl.float32)
    v_lo = tl.load(v_ptr + at, mask=ok[:, None], other=0.0).to(tl.float32)
    v_hi = tl.load(v_ptr + at + HALF, mask=ok[:, None], other=0.0).to(tl.float32)
    score = (tl.sum(k_lo * q_lo[None, :], axis=1) + tl.sum(k_hi * q_hi[None, :], axis=1)) * scale
    score = tl.where(ok, score, float("-inf"))
    m = tl.max(score, axis=0)
    if c == 0:  # the new position's key and value
        new_lo = tl.load(src + (HEADS + g) * D + d).to(tl.float32)
        new_hi = tl.load(src + (HEADS + g) * D + HALF + d).to(tl.float32)
        new_lo, new_hi = _head_norm_rope(new_lo, new_hi, kn_ptr, cos_ptr, sin_ptr, pos, eps, dt, HALF)
        val_lo = tl.load(src + (HEADS + KV_HEADS + g) * D + d).to(tl.float32)
        val_hi = tl.load(src + (HEADS + KV_HEADS + g) * D + HALF + d).to(tl.float32)
        if h % GROUP == 0:
            tl.store(k_ptr + cache + pos * scs + d, new_lo.to(dt))
            tl.store(k_ptr + cache + pos * scs + HALF + d, new_hi.to(dt))
            tl.store(v_ptr + cache + pos * scs + d, val_lo.to(dt))
            tl.store(v_ptr + cache + pos * scs + HALF + d, val_hi.to(dt))
        new = (tl.sum(new_lo * q_lo, axis=0) + tl.sum(new_hi * q_hi, axis=0)) * scale
        m = tl.maximum(m, new)
        p_new = tl.exp(new - m)
        p = tl.exp(score - m)
        total = tl.sum(p, axis=0) + p_new
        out_lo = tl.sum(p[:, None] * v_lo, axis=0) + p_new * val_lo
        out_hi = tl.sum(p[:, None] * v_hi, axis=0) + p_new * val_hi
    else:
        p = tl.exp(score - m)
        total = tl.sum(p, axis=0)
        out_lo = tl.sum(p[:, None] * v_lo, axis=0)
        out_hi = tl.sum(p[:, None] * v_hi, axis=0)
    part = part_ptr + ((b * HEADS + h) * SPLITS + c) * (2 + D)
    tl.store(part, m)
    tl.store(part + 1, total)
    tl.store(part + 2 + d, out_lo)
    tl.store(part + 2 + HALF + d, out_hi)


@triton.jit
def _combine_kernel(part_ptr, pos_ptr, spb, out_ptr, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
                    HEADS: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Program (row b, query head h): the softmax over the row's live splits of _split_attention_kernel."""
    _pdl_wait(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + b * spb)
    c = tl.arange(0, SPLITS_P2)
    live = c * CHUNK < tl.maximum(pos, 1)
    part = part_ptr + (b * HEADS + h) * SPLITS * (2 + D) + c * (2 + D)
    m = tl.load(part, mask=live, other=float("-inf"))
    total = tl.load(part + 1, mask=live, other=0.0)
    d = tl.arange(0, D)
    acc = tl.load(part[:, None] + 2 + d[None, :], mask=live[:, None], other=0.0)
    w = tl.where(live, tl.exp(m - tl.max(m, axis=0)), 0.0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * total, axis=0)
    tl.store(out_ptr + (b * HEADS + h) * D + d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _rows_norm_rope(x, partner, norm_ptr, cos_ptr, sin_ptr, pos, eps, dt, D: tl.constexpr):
    """_head_norm_rope for whole heads, one per row of x [R, D]: partner holds each element's rotary partner
    (the other half's element at the same offset), so a head stays one tile of D columns for tl.dot."""
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, D)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1, keep_dims=True) / D + eps)
    x = ((x * rstd).to(dt).to(tl.float32) * tl.load(norm_ptr + d).to(tl.float32)).to(dt).to(tl.float32)
    partner = ((partner * rstd).to(dt).to(tl.float32)
               * tl.load(norm_ptr + (d + HALF) % D).to(tl.float32)).to(dt).to(tl.float32)
    rotated = tl.where(d < HALF, -partner, partner)
    c = tl.load(cos_ptr + pos * D + d).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + pos * D + d).to(dt).to(tl.float32)
    return ((x * c).to(dt).to(tl.float32) + (rotated * s).to(dt).to(tl.float32)).to(dt)


@triton.jit
def _row_attention_kernel(qkv_ptr, qn_ptr, kn_ptr, eps, cos_ptr, sin_ptr, pos_ptr, spb, slot_ptr,
                          k_ptr, v_ptr, scb, sch, scs, out_ptr, scale, HEADS: tl.constexpr,
                          KV_HEADS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, DOT_F32: tl.constexpr,
                          SLOTS: tl.constexpr, STORE: tl.constexpr, ATTEND: tl.constexpr):
    """_split_attention_kernel's work for many rows: program (row b, key/value head g) normalises and rotates
    the group's queries (padded to a 16-row tile for tl.dot) and the row's new key, caches the key and value
    (STORE), and attends over the row's positions [0, pos] only (ATTEND), BLOCK keys at a time with an online
    softmax, each key and value read once for the group; the new position's key and value come from registers,
    so no load waits for a store. Scores and the softmax in float32, probabilities rounded to the cache's dtype
    for the product with the values (as flash attention does). Row b's cache is the cache's row b, or with SLOTS
    the row slot_ptr[b] names (a prompt's positions as rows: row_attention stores them all in one launch and
    attends in a second)."""
    b = tl.program_id(0)
    g = tl.program_id(1)
    HALF: tl.constexpr = D // 2
    GROUP: tl.constexpr = HEADS // KV_HEADS
    dt = k_ptr.dtype.element_ty
    d = tl.arange(0, D)
    partner = (d + HALF) % D
    pos = tl.load(pos_ptr + b * spb)
    src = qkv_ptr + b * (HEADS + 2 * KV_HEADS) * D
    k_at = src + (HEADS + g) * D
    new_k = _rows_norm_rope(tl.load(k_at + d[None, :]).to(tl.float32), tl.load(k_at + partner[None, :]).to(tl.float32),
                            kn_ptr, cos_ptr, sin_ptr, pos, eps, dt, D)
    new_v = tl.load(src + (HEADS + KV_HEADS + g) * D + d[None, :]).to(dt)
    if SLOTS:
        cache = tl.load(slot_ptr + b) * scb + g * sch
    else:
        cache = b * scb + g * sch
    if STORE:
        tl.store(k_ptr + cache + pos * scs + d[None, :], new_k)
        tl.store(v_ptr + cache + pos * scs + d[None, :], new_v)
    if ATTEND:
        _row_attend(qkv_ptr, qn_ptr, eps, cos_ptr, sin_ptr, pos, src, new_k, new_v, k_ptr, v_ptr, cache, scs,
                    out_ptr + b * HEADS * D, g, scale, HEADS, GROUP, D, BLOCK, DOT_F32)


@triton.jit
def _row_attend(qkv_ptr, qn_ptr, eps, cos_ptr, sin_ptr, pos, src, new_k, new_v, k_ptr, v_ptr, cache, scs, out_ptr,
                g, scale, HEADS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                DOT_F32: tl.constexpr):
    """_row_attention_kernel's attention of one row's query group over its positions [0, pos]."""
    HALF: tl.constexpr = D // 2
    dt = k_ptr.dtype.element_ty
    d = tl.arange(0, D)
    partner = (d + HALF) % D
    qi = tl.arange(0, 16)
    q_ok = (qi < GROUP)[:, None]
    q_at = src + (g * GROUP + qi)[:, None] * D
    q = _rows_norm_rope(tl.load(q_at + d[None, :], mask=q_ok, other=0.0).to(tl.float32),
                        tl.load(q_at + partner[None, :], mask=q_ok, other=0.0).to(tl.float32),
                        qn_ptr, cos_ptr, sin_ptr, pos, eps, dt, D)
    m = tl.full((16,), float("-inf"), tl.float32)
    total = tl.zeros((16,), tl.float32)
    acc = tl.zeros((16, D), tl.float32)
    start = 0
    while start <= pos:  # not range(): the interpreter cannot take a loaded bound as a range's
        s = start + tl.arange(0, BLOCK)
        cached = (s < pos)[:, None]
        here = (s == pos)[:, None]
        at = cache + s[:, None] * scs + d[None, :]
        k = tl.where(here, new_k, tl.load(k_ptr + at, mask=cached, other=0.0))
        scores = _accumulate(tl.zeros((16, BLOCK), tl.float32), q, k, True, DOT_F32) * scale
        scores = tl.where((s <= pos)[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.where(here, new_v, tl.load(v_ptr + at, mask=cached, other=0.0))
        acc = _accumulate(acc * alpha[:, None], p.to(dt), tl.trans(v), True, DOT_F32)
        m = m_new
        start += BLOCK
    tl.store(out_ptr + (g * GROUP + qi)[:, None] * D + d[None, :], (acc / total[:, None]).to(dt), mask=q_ok)


GEMV_ROWS = 4  # calls of up to this many rows multiply element by element, larger ones by tl.dot
ROW_BLOCK = 64  # keys per iteration of the row-length attention (the talker's in the wide layers)
# tiles (BLOCK_N, BLOCK_K, warps, stages) by role and kind, from benchmarks/fused_layers_bench.py on an H100
# (gemv: session 12, under programmatic dependent launch, --rows 1,2)
_TILES = {"qkv": {"gemv": (2, 1024, 2, 3), "dot": (32, 128, 4, 3)},
          "gate_up": {"gemv": (2, 1024, 2, 3), "dot": (32, 128, 4, 3)},
          "o": {"gemv": (2, 2048, 4, 3), "dot": (16, 256, 4, 4)},
          "down": {"gemv": (1, 1024, 2, 3), "dot": (16, 256, 4, 4)},
          "head": {"gemv": (4, 1024, 2, 3), "dot": (16, 256, 4, 3)},
          # the attention kernel over a short cache: (query heads per program, warps), for calls of up to
          # MAX_ROWS rows (the fused layers) and for more (the wide layers); fused_layers_bench --attention-only,
          # session 16: one warp per program throughout, a group's two heads per program over 16 rows
          "attention": {"few": (1, 1), "wide": (2, 1)}}


@functools.cache
def _has_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch needs CUDA compute capability 9 (Hopper) or later (asked once per device:
    every eager launch passes here)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _pdl(device: torch.device, rows: int) -> dict:
    """Launch arguments for a call of `rows` rows: PDL (see above) where the device has it; Triton's interpreter
    has none."""
    on = PDL and rows <= PDL_ROWS and not _INTERPRET and _has_pdl(device)
    return dict(PDL=on, launch_pdl=True) if on else dict(PDL=False)


def _launch(m: int, n: int, k: int, role: str, device: torch.device) -> dict:
    """Grid and compile-time arguments of a product of m rows by an n x k weight in `role`; the role's tile is
    narrowed to small weights (tl.dot needs 16 at least in every dimension)."""
    dot = m > GEMV_ROWS
    block_n, block_k, warps, stages = _TILES[role]["dot" if dot else "gemv"]
    least = 16 if dot else 1
    block_n = min(block_n, max(least, triton.next_power_of_2(n)))
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    return dict(grid=(triton.cdiv(n, block_n),), BLOCK_M=MAX_ROWS if dot else triton.next_power_of_2(m),
                BLOCK_N=block_n, BLOCK_K=block_k, DOT=dot, DOT_F32=_DOT_F32, num_warps=warps, num_stages=stages,
                **_pdl(device, m))


def norm_matmul(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, role: str,
                gated: bool = False) -> torch.Tensor:
    """RMSNorm(x) @ weight^T for x [M, K] (rows may be strided), M <= MAX_ROWS; gated: weight is [gate; up]
    and the result SiLU(gate) * up."""
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    launch = _launch(m, n, k, role, x.device)
    _norm_matmul_kernel[launch.pop("grid")](x, x.stride(0), norm_weight, weight, out, m, k, n, eps, GATED=gated,
                                            **launch)
    return out


def matmul_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, role: str) -> torch.Tensor:
    """residual + x @ weight^T, x [M, K] and residual [M, N] contiguous, M <= MAX_ROWS."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty_like(residual)
    launch = _launch(m, n, k, role, x.device)
    _matmul_residual_kernel[launch.pop("grid")](x, weight, residual, out, m, k, n, **launch)
    return out


def attention(qkv: torch.Tensor, attn, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
              k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """Attention.forward after its projection, for the L = M / B new positions of each row: qkv [M, (H+2KV)D]
    -> [M, H D]; keys and values go into k_cache/v_cache [B, KV, S, D] at `positions` [B, L], and position p
    attends to the cached positions 0..p. A cache of up to MAX_KEYS positions is held in registers whole; a
    longer one (the talker's) takes one new position per row, its keys read in splits of MAX_KEYS at once."""
    batch, seq = positions.shape
    out = torch.empty((qkv.shape[0], attn.num_heads * attn.head_dim), dtype=qkv.dtype, device=qkv.device)
    shared = (qkv, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, cos, sin, positions)
    pdl = _pdl(qkv.device, qkv.shape[0])
    if k_cache.shape[2] <= MAX_KEYS:
        heads_per, warps = _TILES["attention"]["few" if qkv.shape[0] <= MAX_ROWS else "wide"]
        if (attn.num_heads // attn.num_kv_heads) % heads_per:
            heads_per = 1
        _attention_kernel[(batch, attn.num_heads // heads_per)](
            *shared, *positions.stride(), k_cache, v_cache, *k_cache.stride()[:3], out, attn.scale, L=seq,
            HEADS=attn.num_heads, KV_HEADS=attn.num_kv_heads, HALF=attn.head_dim // 2,
            KEYS=triton.next_power_of_2(k_cache.shape[2]), HEADS_PER=heads_per, num_warps=warps, **pdl)
    elif seq == 1:
        splits = triton.cdiv(k_cache.shape[2], MAX_KEYS)
        part = torch.empty((batch, attn.num_heads, splits, 2 + attn.head_dim), dtype=torch.float32,
                           device=qkv.device)
        _split_attention_kernel[(batch, attn.num_heads, splits)](
            *shared, positions.stride(0), k_cache, v_cache, *k_cache.stride()[:3], part, attn.scale, SPLITS=splits,
            HEADS=attn.num_heads, KV_HEADS=attn.num_kv_heads, HALF=attn.head_dim // 2, CHUNK=MAX_KEYS, **pdl)
        _combine_kernel[(batch, attn.num_heads)](part, positions, positions.stride(0), out, SPLITS=splits,
                                                 SPLITS_P2=triton.next_power_of_2(splits), HEADS=attn.num_heads,
                                                 D=attn.head_dim, CHUNK=MAX_KEYS, **pdl)
    else:
        raise ValueError(f"{seq} new positions per row over a cache of {k_cache.shape[2]} (> {MAX_KEYS}): "
                         "the fused layers take one")
    return out


def row_attention(qkv: torch.Tensor, attn, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """attention() for many rows of one new position each over a cache of any length (the talker's steps in the
    wide layers): a program per row and key/value head reads only that row's positions, where a KV bucket's
    SDPA reads every row up to the longest (on an H100, ~3.7 us per position of the bucket at 128 rows).
    Row i's cache is k_cache[i], or k_cache[slots[i]] where `slots` [rows] is given: a new prompt's positions as
    rows of one slot, which attend to each other; then every row's key and value are stored first, and the rows
    attend in a second launch. `out` [rows, heads x head_dim]: where the result goes (default: a new tensor)."""
    batch, seq = positions.shape
    if seq != 1:
        raise ValueError(f"{seq} new positions per row over a cache of {k_cache.shape[2]} (> {MAX_KEYS}): the "
                         "wide layers take one")
    if out is None:
        out = torch.empty((batch, attn.num_heads * attn.head_dim), dtype=qkv.dtype, device=qkv.device)
    passes = ((True, True),) if slots is None else ((True, False), (False, True))
    for store, attend in passes:
        _row_attention_kernel[(batch, attn.num_kv_heads)](
            qkv, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, cos, sin, positions, positions.stride(0),
            slots if slots is not None else positions,  # slot_ptr: read only with SLOTS (any pointer otherwise)
            k_cache, v_cache, *k_cache.stride()[:3], out, attn.scale,
            HEADS=attn.num_heads, KV_HEADS=attn.num_kv_heads, D=attn.head_dim, BLOCK=ROW_BLOCK, DOT_F32=_DOT_F32,
            SLOTS=slots is not None, STORE=store, ATTEND=attend, num_warps=4, num_stages=3)
    return out


@dataclass
class Prompts:
    """New prompts' positions as rows of a wide talker step (WideStack.__call__): inputs x [T, H], each row's slot
    [T] and cache position [T, 1], and the whole cache's keys and values [layers, slots, KV, S, D]."""

    x: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


class FusedStack:
    """A DecoderStack's decode passes through the kernels above (see supports for which stacks and calls)."""

    def __init__(self, stack: DecoderStack):
        self.stack = stack

    @staticmethod
    def supports(stack: DecoderStack) -> bool:
        """Stacks without attention biases, with head_dim a power of two."""
        cfg = stack.cfg
        d = cfg.head_dim
        return not cfg.attention_bias and d >= 2 and d & (d - 1) == 0

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> torch.Tensor:
        """x [B, L, H] at rope and cache `positions` [B, L] (B L <= MAX_ROWS), each attending to the cached
        positions up to its own (DecoderStack.forward with mask=None) -> the last layer's output [B, L, H]
        before the final norm (head() applies it); k_cache/v_cache [layers, B, KV, S, D] are written."""
        batch, seq, hidden = x.shape
        if batch * seq > MAX_ROWS:
            raise ValueError(f"{batch} x {seq} rows exceed the fused layers' {MAX_ROWS}")
        rotary = self.stack.rotary
        h = x.reshape(batch * seq, hidden)
        for i, layer in enumerate(self.stack.layers):
            attn, mlp = layer.self_attn, layer.mlp
            norm = layer.input_layernorm
            qkv = norm_matmul(h, norm.weight, norm.eps, attn.fused_weight, "qkv")
            a = attention(qkv, attn, rotary.cos, rotary.sin, positions, k_cache[i], v_cache[i])
            h = matmul_residual(a, attn.o_proj.weight, h, "o")
            norm = layer.post_attention_layernorm
            a = norm_matmul(h, norm.weight, norm.eps, mlp.fused_weight, "gate_up", gated=True)
            h = matmul_residual(a, mlp.down_proj.weight, h, "down")
        return h.view(batch, seq, hidden)

    def head(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The stack's final norm of x [B, H] (rows may be strided) and a bias-free head: [B, V]."""
        norm = self.stack.norm
        return norm_matmul(x, norm.weight, norm.eps, weight, "head")


def _project(h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
    """A layer's input norm and fused q/k/v projection."""
    return F.linear(rms_norm(h, norm_weight, eps), weight)


def _layer_tail(a, h, o_weight, post_norm, eps, gate_up, down, next_norm=None, next_qkv=None):
    """A layer after its attention: output projection + residual, post-attention norm, SwiGLU MLP + residual;
    then the next layer's norm and q/k/v projection (next_qkv given), so the residual sum and that norm fuse.
    a, h [B, L, *]: over 2-D rows Inductor turns `h + x @ w^T` into cuBLAS's addmm, which first copies h into its
    output (two copy kernels per layer, 150 per frame in the H100 profile) and rounds the sum once, where the
    modules round the product first."""
    h = h + F.linear(a, o_weight)
    gate, up = F.linear(rms_norm(h, post_norm, eps), gate_up).chunk(2, dim=-1)
    h = h + F.linear(F.silu(gate) * up, down)
    return h, (None if next_qkv is None else _project(h, next_norm, eps, next_qkv))


class WideStack:
    """A DecoderStack's decode passes of many rows: torch's products, and for each layer's attention kernel 2
    above over a short cache (the code predictor's) or row_attention over a long one (the talker's, one new
    position per row). compile() fuses the norms, SiLU and residual sums between the products (torch.compile,
    one graph for every layer); uncompiled it runs the same maths eagerly."""

    def __init__(self, stack: DecoderStack):
        self.stack = stack
        self._project, self._tail = _project, _layer_tail

    @staticmethod
    def supports(stack: DecoderStack) -> bool:
        """FusedStack's stacks whose query groups fit row_attention's 16-row tile, head_dim 16 at least (tl.dot)."""
        cfg = stack.cfg
        group, rest = divmod(cfg.num_attention_heads, cfg.num_key_value_heads)
        return FusedStack.supports(stack) and not rest and group <= 16 and cfg.head_dim >= 16

    def compile(self) -> None:
        self._project = torch.compile(_project, dynamic=True)
        self._tail = torch.compile(_layer_tail, dynamic=True)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, prompts: Prompts | None = None):
        """As FusedStack.__call__, for any number of rows; over a cache of more than MAX_KEYS positions, one new
        position per row. With `prompts` (the talker's cache only) new prompts' positions ride along as rows of
        their own, through the same products, and the result is (x's rows' output, the prompts' rows' [T, 1, H]):
        a prefill that costs a step's rows, not a pass of its own. In each layer x's rows attend first, so a
        prompt's keys land after what an empty slot's row of x writes at position 0."""
        attend = attention if k_cache.shape[3] <= MAX_KEYS else row_attention
        batch, seq, _ = x.shape
        if prompts is not None:
            if attend is attention or seq != 1:
                raise ValueError("prompts ride along only with one new position per row over a long cache")
            x = torch.cat([x, prompts.x[:, None].to(x.dtype)])
        rows = x.shape[0]
        layers, rotary = self.stack.layers, self.stack.rotary
        eps = layers[0].input_layernorm.eps
        h = x
        qkv = self._project(h, layers[0].input_layernorm.weight, eps, layers[0].self_attn.fused_weight)
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            flat = qkv.view(rows * seq, -1)
            if prompts is None:
                a = attend(flat, attn, rotary.cos, rotary.sin, positions, k_cache[i], v_cache[i])
            else:
                a = torch.empty((rows, attn.num_heads * attn.head_dim), dtype=qkv.dtype, device=qkv.device)
                row_attention(flat[:batch], attn, rotary.cos, rotary.sin, positions, k_cache[i], v_cache[i],
                              out=a[:batch])
                row_attention(flat[batch:], attn, rotary.cos, rotary.sin, prompts.positions, prompts.k[i],
                              prompts.v[i], slots=prompts.slots, out=a[batch:])
            following = (layers[i + 1].input_layernorm.weight, layers[i + 1].self_attn.fused_weight) \
                if i + 1 < len(layers) else ()
            h, qkv = self._tail(a.view(rows, seq, -1), h, attn.o_proj.weight, layer.post_attention_layernorm.weight,
                                eps, mlp.fused_weight, mlp.down_proj.weight, *following)
        return h if prompts is None else (h[:batch], h[batch:])
