"""The vocoder on CUDA: every convolution as a window product (triton_conv.py, channels innermost, with the
residual units' SnakeBeta and addition in its epilogue) and the remaining SnakeBetas as one Triton pass each.

At the sample-rate stages of the codec (96-192 channels, 1920 samples per frame) the elementwise passes and
cuDNN's layout conversions, not the products, were most of a codec call on an H100 (a 64 x 25-frame call: cuDNN's
products ~15 ms, its conversions ~10, SnakeBeta 8, the residual additions and bias passes ~8;
docs/perf-raw/2026-11-22-h100-s6-codec-ab-history-buffer-raw.tar.xz). Installed, a residual unit is one SnakeBeta
pass into its k7 convolution's history buffer, the k7 product with the next SnakeBeta (and the bias) in its
epilogue, and the k1 product with the bias and the residual in its epilogue; the activations stay (B, L, C)
from the transformer's output to the waveform.

`install(decoder)` points the decoder's SnakeBetas and convolutions at these kernels; the torch modules stay the
definition of the maths and the CPU path.
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from serving.engine.triton_conv import FAST_SIN, conv_matrix, snake_beta, transposed_matrix, window_product
from serving.model.codec_decoder import CausalConv1d, CausalConvTranspose1d, SnakeBeta, channels_innermost


def _tiles(x_bcl: torch.Tensor) -> tuple[int, int]:
    """(BLOCK_C, BLOCK_L) of a program: long along whichever axis is contiguous, so its loads coalesce."""
    c, length = x_bcl.shape[1:]
    if channels_innermost(x_bcl):
        block_c = min(128, triton.next_power_of_2(c))
        return block_c, max(1, 4096 // block_c)
    return 1 if length >= 1024 else 4, min(1024, triton.next_power_of_2(max(length, 16)))


@triton.jit
def _snake_kernel(x_ptr, sxb, sxc, sxl, out_ptr, sob, soc, sol, alpha_ptr, beta_ptr, channels, length, valid_ptr,
                  T_PER_FRAME, SKIP: tl.constexpr, FAST_SIN: tl.constexpr, BLOCK_C: tl.constexpr,
                  BLOCK_L: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    if SKIP:  # past the row's valid frames (see triton_conv.window_product's `valid`)
        if tl.program_id(2) * BLOCK_L >= tl.load(valid_ptr + b) * T_PER_FRAME:
            return
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t = (tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)).to(tl.int64)
    c_ok = c < channels
    inside = c_ok[:, None] & (t < length)[None, :]
    x = tl.load(x_ptr + b * sxb + c[:, None] * sxc + t[None, :] * sxl, mask=inside, other=0.0).to(tl.float32)
    y = snake_beta(x, tl.load(alpha_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[:, None],
                   tl.load(beta_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[:, None], FAST_SIN)
    tl.store(out_ptr + b * sob + c[:, None] * soc + t[None, :] * sol, y.to(out_ptr.dtype.element_ty), mask=inside)


def snake(x_bcl: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, out: torch.Tensor | None = None,
          valid: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """codec_decoder.snake_reference in one pass (into `out`, any strides, if given; else laid out as x); with
    `valid` (each row's leading valid frames, samples per frame), only those (see window_product)."""
    b, c, length = x_bcl.shape
    if out is None:
        out = torch.empty_like(x_bcl)
    elif out.shape != x_bcl.shape:
        raise ValueError(f"snake output {tuple(out.shape)} for an input of {tuple(x_bcl.shape)}")
    if out.numel():
        block_c, block_l = _tiles(x_bcl)
        frames, per_frame = valid if valid is not None else (alpha, 0)
        _snake_kernel[(b, triton.cdiv(c, block_c), triton.cdiv(length, block_l))](
            x_bcl, *x_bcl.stride(), out, *out.stride(), alpha, beta, c, length, frames, per_frame,
            SKIP=valid is not None, FAST_SIN=FAST_SIN, BLOCK_C=block_c, BLOCK_L=block_l)
    return out


def _product(module: CausalConv1d | CausalConvTranspose1d) -> Callable:
    """The module's `product`: (history-prefixed input (B, C, L'), then, residual, valid) -> output (B, C_out,
    L_out) laid out (B, L_out, C_out), from the module's weights as they are now (prepacked once); `valid` as
    window_product's (Frames.valid)."""
    conv = module.conv
    if isinstance(module, CausalConvTranspose1d):
        stride = conv.stride[0]
        matrix, taps, dilation, phases = transposed_matrix(conv.weight, stride), module.history + 1, 1, stride
    else:
        matrix, taps, dilation, phases = conv_matrix(conv.weight), conv.kernel_size[0], conv.dilation[0], 1
    bias = conv.bias if conv.bias is not None else conv.weight.new_zeros(conv.out_channels)

    def product(full_bcl: torch.Tensor, then: SnakeBeta | None, residual: torch.Tensor | None,
                valid: tuple[torch.Tensor, int] | None) -> torch.Tensor:
        out = window_product(full_bcl.transpose(1, 2), matrix, bias, taps, dilation, phases,
                             snake=(then.alpha, then.beta) if then is not None else None,
                             residual=residual.transpose(1, 2) if residual is not None else None, valid=valid)
        return out.transpose(1, 2)

    return product


def install(decoder: torch.nn.Module) -> bool:
    """Point the decoder's SnakeBetas and (ungrouped) convolutions at the kernels, in place; returns whether any.
    Install after the weights are final: each convolution's are prepacked here."""
    found = False
    for module in decoder.modules():
        if isinstance(module, SnakeBeta):
            module.kernel = snake
            found = True
        elif isinstance(module, (CausalConv1d, CausalConvTranspose1d)) and module.conv.groups == 1:
            module.product = _product(module)
            found = True
    return found
