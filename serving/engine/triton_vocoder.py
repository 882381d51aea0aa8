"""The vocoder's per-sample elementwise work as Triton kernels, for CUDA: SnakeBeta (with the bias of the
convolution before it folded in) and the residual units' addition (with the bias of the convolution before it).

At the sample-rate stages of the codec (96-192 channels, 1920 samples per frame) the elementwise passes, not
the convolutions, were most of a codec call on an H100: a compiled SnakeBeta took 26% of a 64 x 25-frame call
and the convolutions' bias additions (a broadcast `add_` after each cuDNN call, not vectorized) another 18%
(docs/perf-raw/2026-11-21-h100-s2-codec-profile-bf16-compiled-snake.txt). Here a residual unit's two biases
ride along in the kernels that read those tensors anyway. One program handles one (row, channel) strip of
samples, so a channel's parameters are loaded once and no per-sample index arithmetic picks them; inputs may
be strided (a transposed convolution's output is a slice), and so may SnakeBeta's output: given `out`, it
writes straight behind a causal convolution's history (codec_decoder.Frames.with_history), saving the
concatenation that would copy it there. Arithmetic is float32 whatever the storage dtype.

`install(decoder)` points every SnakeBeta and ResidualUnit of a decoder at these kernels; the plain torch modules
stay the definition of the maths and the CPU path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from serving.model.codec_decoder import ResidualUnit, SnakeBeta


def _block(length: int) -> int:
    return min(1024, triton.next_power_of_2(max(length, 16)))


@triton.jit
def _snake_kernel(x_ptr, sxb, sxc, sxl, out_ptr, sob, soc, sol, alpha_ptr, beta_ptr, bias_ptr, channels, length,
                  HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # b * channels + c
    b = row // channels
    c = row % channels
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = t < length
    x = tl.load(x_ptr + b * sxb + c * sxc + t * sxl, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(bias_ptr + c).to(tl.float32)
    alpha = tl.exp(tl.load(alpha_ptr + c).to(tl.float32))
    inv_beta = 1.0 / (tl.exp(tl.load(beta_ptr + c).to(tl.float32)) + 1e-9)
    s = tl.sin(x * alpha)
    tl.store(out_ptr + b * sob + c * soc + t * sol, (x + inv_beta * s * s).to(out_ptr.dtype.element_ty),
             mask=inside)


@triton.jit
def _residual_kernel(x_ptr, sxb, sxc, sxl, y_ptr, syb, syc, syl, bias_ptr, out_ptr, channels, length,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = row // channels
    c = row % channels
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = t < length
    x = tl.load(x_ptr + b * sxb + c * sxc + t * sxl, mask=inside, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + b * syb + c * syc + t * syl, mask=inside, other=0.0).to(tl.float32)
    y += tl.load(bias_ptr + c).to(tl.float32)
    tl.store(out_ptr + row * length + t, (x + y).to(out_ptr.dtype.element_ty), mask=inside)


def snake(x_bcl: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
          bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """codec_decoder.snake_reference in one pass (into `out`, any strides, if given)."""
    b, c, length = x_bcl.shape
    if out is None:
        out = torch.empty((b, c, length), dtype=x_bcl.dtype, device=x_bcl.device)
    elif out.shape != x_bcl.shape:
        raise ValueError(f"snake output {tuple(out.shape)} for an input of {tuple(x_bcl.shape)}")
    if out.numel():
        block = _block(length)
        _snake_kernel[(b * c, triton.cdiv(length, block))](
            x_bcl, *x_bcl.stride(), out, *out.stride(), alpha, beta, alpha if bias is None else bias, c, length,
            HAS_BIAS=bias is not None, BLOCK=block)
    return out


def residual(x_bcl: torch.Tensor, y_bcl: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x + y + bias (per channel) in one pass."""
    b, c, length = x_bcl.shape
    out = torch.empty((b, c, length), dtype=x_bcl.dtype, device=x_bcl.device)
    if out.numel():
        block = _block(length)
        _residual_kernel[(b * c, triton.cdiv(length, block))](
            x_bcl, *x_bcl.stride(), y_bcl, *y_bcl.stride(), bias, out, c, length, BLOCK=block)
    return out


def install(decoder: torch.nn.Module) -> bool:
    """Point the decoder's SnakeBetas and residual additions at the kernels (in place); returns whether any."""
    found = False
    for module in decoder.modules():
        if isinstance(module, SnakeBeta):
            module.kernel = snake
            found = True
        elif isinstance(module, ResidualUnit):
            module.add_kernel = residual
    return found
