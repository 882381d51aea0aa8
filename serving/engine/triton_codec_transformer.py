"""The codec transformer's norms, rotary and scaled residual additions on CUDA, as one Triton pass each.

A codec call costs ~2.5 ms on an H100 whatever it carries (1 x 1 frame), ~600 small kernels, and short text
pays it for every first and final chunk (docs/performance.md, twenty-fifth pass). Of those kernels the
transformer's 17 RMSNorms were 8 each (a float32 copy, square, mean, epsilon, rsqrt, product, rounding copy,
weight) and the rotary of each layer's queries and keys 6 each (slices, negation, concatenation, two products,
sum), and each LayerScale with its residual addition 2: here each is one kernel, with the same roundings as the
torch reference (float32 inside, rounded to the input's dtype where the reference rounds).

`install(decoder)` points the codec transformer's norms, layer scales and attention at these kernels; the torch
functions stay the definition of the maths and the CPU path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from serving.model.codec_decoder import Attention, LayerScale, TransformerNorm


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n, eps, BLOCK: tl.constexpr):
    """Row program_id(0) of x [rows, n]: weight * round(x / rms(x)), as layers.rms_norm."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * n + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layers.rms_norm over x's last dimension in one pass (x made contiguous if it is not)."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, n, eps, BLOCK=triton.next_power_of_2(n))
    return out.view(x.shape)


@triton.jit
def _rope_kernel(x_ptr, sb, sh, st, out_ptr, cos_ptr, sin_ptr, heads, length, HALF: tl.constexpr):
    """Position t of head h of row b (program (b * heads + h, t)): x * cos + rotate_half(x) * sin, each product
    and the sum rounded to x's dtype as the reference's three ops are."""
    bh = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1).to(tl.int64)
    b, h = bh // heads, bh % heads
    d = tl.arange(0, HALF)
    src = x_ptr + b * sb + h * sh + t * st
    dt = out_ptr.dtype.element_ty
    lo = tl.load(src + d).to(tl.float32)
    hi = tl.load(src + HALF + d).to(tl.float32)
    c_lo = tl.load(cos_ptr + t * 2 * HALF + d).to(tl.float32)
    c_hi = tl.load(cos_ptr + t * 2 * HALF + HALF + d).to(tl.float32)
    s_lo = tl.load(sin_ptr + t * 2 * HALF + d).to(tl.float32)
    s_hi = tl.load(sin_ptr + t * 2 * HALF + HALF + d).to(tl.float32)
    out_lo = (lo * c_lo).to(dt).to(tl.float32) + (-hi * s_lo).to(dt).to(tl.float32)
    out_hi = (hi * c_hi).to(dt).to(tl.float32) + (lo * s_hi).to(dt).to(tl.float32)
    dst = out_ptr + (bh * length + t) * 2 * HALF
    tl.store(dst + d, out_lo.to(dt))
    tl.store(dst + HALF + d, out_hi.to(dt))


def rope(x_bhtd: torch.Tensor, cos_td: torch.Tensor, sin_td: torch.Tensor) -> torch.Tensor:
    """codec_decoder.rope_reference for x (B, H, T, D) in any layout whose last dimension is contiguous (the
    projections' transposed views), cos/sin (T, D) of x's dtype; returns a contiguous (B, H, T, D)."""
    b, heads, length, dim = x_bhtd.shape
    if x_bhtd.stride(3) != 1:
        x_bhtd = x_bhtd.contiguous()
    cos_td, sin_td = cos_td.contiguous(), sin_td.contiguous()
    out = torch.empty((b, heads, length, dim), dtype=torch.promote_types(x_bhtd.dtype, cos_td.dtype),
                      device=x_bhtd.device)
    if out.numel():
        _rope_kernel[(b * heads, length)](x_bhtd, *x_bhtd.stride()[:3], out, cos_td, sin_td, heads, length,
                                          HALF=dim // 2)
    return out


@triton.jit
def _scaled_residual_kernel(x_ptr, scale_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Row program_id(0) of [rows, n]: x + round(scale * y), as codec_decoder.scaled_residual_reference."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * n + cols, mask=ok, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + row * n + cols, mask=ok, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (x + (scale * y).to(dt).to(tl.float32)).to(dt), mask=ok)


def scaled_residual(x: torch.Tensor, scale: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """codec_decoder.scaled_residual_reference in one pass, for x and y of one shape and dtype, scale over their last
    dimension (each made contiguous if it is not)."""
    n = x.shape[-1]
    x_rows, y_rows = x.reshape(-1, n).contiguous(), y.reshape(-1, n).contiguous()
    out = torch.empty(x_rows.shape, dtype=x.dtype, device=x.device)
    if x_rows.shape[0]:
        _scaled_residual_kernel[(x_rows.shape[0],)](x_rows, scale, y_rows, out, n, BLOCK=triton.next_power_of_2(n))
    return out.view(x.shape)


def install(decoder: torch.nn.Module) -> bool:
    """Point the decoder's transformer norms, layer scales and attentions at the kernels (head_dim a power of two,
    as tl.arange needs); returns whether any."""
    found = False
    for module in decoder.modules():
        if isinstance(module, TransformerNorm):
            module.kernel = rms_norm
            found = True
        elif isinstance(module, LayerScale):
            module.kernel = scaled_residual
            found = True
        elif isinstance(module, Attention) and module.head_dim >= 2 and not module.head_dim & (module.head_dim - 1):
            module.rope = rope
            found = True
    return found
