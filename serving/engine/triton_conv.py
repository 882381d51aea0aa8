"""The codec's convolutions as one Triton kernel, for CUDA: a matrix product over a window of input rows.

A causal convolution (kernel k, dilation d) with its history prepended is out[t] = sum_j W_j x[t + j d], and a
causal transposed convolution (kernel m r, stride r) is, for each input row, r output rows from the last m
inputs: both are a product whose left operand's row t is a window of the input (taps j = 0..J-1, rows d apart)
and whose columns are P phases x C_out channels (P = 1 for a convolution, the stride for a transposed one).
With channels innermost (B, L, C), a window row is J stretches of contiguous channels, read in place: no
im2col copy and no layout conversion. cuDNN wants channels innermost for its half-precision kernels and
converted the codec's (B, C, L) activations to and from that layout around every convolution (~20% of a
64 x 25-frame codec call on an H100, docs/perf-raw/2026-11-22-h100-s6-codec-ab-history-buffer-raw.tar.xz).

The epilogue adds the bias and, optionally, applies SnakeBeta (the activation the next convolution reads) and
adds a residual, so the residual units' elementwise passes ride along. Accumulation is float32. On a GPU the
sine is the hardware's approximate one (`snake_beta`): libdevice's exact sinf keeps a local array for its slow
range reduction, which spilled the product's registers and made a 96-channel k7 call 1.8x slower on an H100
(docs/perf-raw/2026-11-26-h100-s25-*); the approximation's error (~1e-6 near zero, growing slowly with the
argument) is far below half precision's.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

FAST_SIN = os.environ.get("TRITON_INTERPRET") != "1"  # the interpreter has no libdevice


@triton.jit
def snake_beta(x, alpha_log, beta_log, FAST_SIN: tl.constexpr):
    """SnakeBeta in float32 of x (any shape) with per-channel parameters (as logs) broadcast against it."""
    z = x * tl.exp(alpha_log)
    if FAST_SIN:
        s = libdevice.fast_sinf(z)
    else:
        s = tl.sin(z)
    return x + s * s / (tl.exp(beta_log) + 1e-9)


@triton.jit
def _window_product_kernel(
        x_ptr, sxb, sxl, sxc,  # input (B, L_in, C): output row t reads rows t + j * DIL
        w_ptr,  # (J * C, N) contiguous, N = P * COUT: row j * C + c, column p * COUT + n
        bias_ptr, alpha_ptr, beta_ptr,  # (COUT,) each; SnakeBeta's parameters as logs
        res_ptr, srb, srl, src,  # residual (B, L * P, COUT)
        out_ptr, sob, sol, soc,  # output (B, L * P, COUT)
        C, COUT, L, N, tiles_per_row,
        valid_ptr, T_PER_FRAME,  # (B,) each row's leading valid frames, and output rows t per frame (SKIP)
        J: tl.constexpr, DIL: tl.constexpr, P: tl.constexpr, SNAKE: tl.constexpr, RESIDUAL: tl.constexpr,
        SKIP: tl.constexpr, FAST_SIN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // tiles_per_row).to(tl.int64)
    if SKIP:  # a tile past the row's valid frames: nothing valid reads it (see window_product)
        if (pid % tiles_per_row) * BLOCK_M >= tl.load(valid_ptr + b) * T_PER_FRAME:
            return
    t = (pid % tiles_per_row) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    row_ok = t < L
    col_ok = n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_rows = x_ptr + b * sxb + t[:, None].to(tl.int64) * sxl
    for j in tl.static_range(J):
        for c0 in range(0, C, BLOCK_K):
            c = c0 + k
            a = tl.load(x_rows + j * DIL * sxl + c[None, :] * sxc, mask=row_ok[:, None] & (c < C)[None, :],
                        other=0.0)
            w = tl.load(w_ptr + (j * C + c)[:, None] * N + n[None, :], mask=(c < C)[:, None] & col_ok[None, :],
                        other=0.0)
            acc = tl.dot(a, w, acc)
    channel = n % COUT
    acc += tl.load(bias_ptr + channel, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if SNAKE:
        acc = snake_beta(acc, tl.load(alpha_ptr + channel, mask=col_ok, other=0.0).to(tl.float32)[None, :],
                         tl.load(beta_ptr + channel, mask=col_ok, other=0.0).to(tl.float32)[None, :], FAST_SIN)
    rows = t[:, None].to(tl.int64) * P + (n // COUT)[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    if RESIDUAL:
        acc += tl.load(res_ptr + b * srb + rows * srl + channel[None, :] * src, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + b * sob + rows * sol + channel[None, :] * soc, acc.to(out_ptr.dtype.element_ty), mask=ok)


def conv_matrix(weight: torch.Tensor) -> torch.Tensor:
    """A Conv1d weight (C_out, C, k) as the product's right operand (k * C, C_out)."""
    c_out, c, k = weight.shape
    return weight.permute(2, 1, 0).reshape(k * c, c_out).contiguous()


def transposed_matrix(weight: torch.Tensor, stride: int) -> torch.Tensor:
    """A ConvTranspose1d weight (C, C_out, m * stride) as the right operand (m * C, stride * C_out): tap j reads
    the input m - 1 - j rows back, whose kernel taps are (m - 1 - j) * stride + phase."""
    c, c_out, kernel = weight.shape
    m = kernel // stride
    return weight.view(c, c_out, m, stride).flip(2).permute(2, 0, 3, 1).reshape(m * c, stride * c_out).contiguous()


def pick_blocks(rows: int, n: int, c: int, snake: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for `rows` output rows of n columns from c channels a tap: the
    tiles that timed best on an H100 for the codec's shapes (benchmarks/vocoder_conv_bench.py --sweep). Large
    products with the SnakeBeta epilogue need room for its registers: a 32-deep K step (a 96-channel k7 unit
    at 64 x 25 frames: 2.46 -> 1.51 ms), or at 768 channels and more, 8 warps."""
    block_k = 64 if c % 64 == 0 else 32
    block_n = min(128, max(16, triton.next_power_of_2(n)))
    if rows < 8192 and n > 16:  # few rows: smaller tiles, more programs
        return 64, block_n, block_k, 4, 3
    if snake:
        return (128, block_n, 64, 8, 4) if c >= 768 else (128, block_n, 32, 4, 3)
    return 128, block_n, block_k, 4, 3


def window_product(x_blc: torch.Tensor, matrix: torch.Tensor, bias: torch.Tensor, taps: int, dilation: int = 1,
                   phases: int = 1, snake: tuple[torch.Tensor, torch.Tensor] | None = None,
                   residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                   blocks: tuple[int, int, int, int, int] | None = None,
                   valid: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """out (B, L * phases, C_out) from x (B, L + (taps - 1) * dilation, C), any strides: the causal convolution
    (phases 1) or transposed convolution (taps = kernel / stride, phases = stride) whose history x holds first,
    plus bias, then SnakeBeta(alpha, beta) if `snake`, then + residual (B, L * phases, C_out) if given.

    valid (frames (B,) on the device, input rows t per frame): only each row's first frames[b] frames are wanted,
    the rest padding (a codec call's rows padded to its longest chunk, or batch rows of no frames). The
    convolutions are causal, so no wanted output reads a padded one: tiles wholly past a row's frames are not
    computed and hold whatever the buffer held. A codec call of mixed lengths took 1.45-2x less time on an H100,
    one without padding the same (docs/performance.md twenty-ninth pass)."""
    b, rows_in, c = x_blc.shape
    length = rows_in - (taps - 1) * dilation
    n = matrix.shape[1]
    c_out = n // phases
    if matrix.shape[0] != taps * c or c_out * phases != n or length < 0:
        raise ValueError(f"window product of {tuple(x_blc.shape)} by {tuple(matrix.shape)} with {taps} taps, "
                         f"dilation {dilation}, {phases} phases")
    if out is None:
        out = torch.empty((b, length * phases, c_out), dtype=x_blc.dtype, device=x_blc.device)
    if not out.numel():
        return out
    block_m, block_n, block_k, warps, stages = blocks or pick_blocks(b * length, n, c, snake is not None)
    tiles = triton.cdiv(length, block_m)
    alpha, beta = snake if snake is not None else (bias, bias)
    res = residual if residual is not None else out
    frames, per_frame = valid if valid is not None else (bias, 0)
    _window_product_kernel[(b * tiles, triton.cdiv(n, block_n))](
        x_blc, *x_blc.stride(), matrix, bias, alpha, beta, res, *res.stride(), out, *out.stride(),
        c, c_out, length, n, tiles, frames, per_frame, J=taps, DIL=dilation, P=phases, SNAKE=snake is not None,
        RESIDUAL=residual is not None, SKIP=valid is not None, FAST_SIN=FAST_SIN, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return out
