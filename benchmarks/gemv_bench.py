"""Whether a hand-written Triton matmul beats cuBLAS on the frame's skinny matmuls (a few rows times a weight).

A frame's matmuls are ~60% of its GPU time and reach ~40% of the HBM bandwidth (docs/performance.md). This
times, for the 0.6B model's weight shapes and a few row counts, F.linear (cuBLAS) against a simple Triton kernel
(one program per BLOCK_N outputs and BLOCK_M rows, the whole K, tl.dot) over a sweep of tile sizes, 20 calls in
a CUDA graph, and prints the effective bandwidth. A measurement to decide on, not code the server runs.

    python benchmarks/gemv_bench.py [--rows 1,8,32,128]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from graph_timing import us_per_call

SHAPES = {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024),
          "cp_head": (1024, 2048), "codec_head": (1024, 3072)}  # (K, N) of the 0.6B talker / code predictor


@triton.jit
def _skinny(x_ptr, w_ptr, y_ptr, M, N, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        rk = k + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=rm[:, None] < M, other=0.0)
        b = tl.load(w_ptr + rn[None, :] * K + rk[:, None])
        acc += tl.dot(a, b)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=rm[:, None] < M)


def skinny(x, w, block_n, block_k, warps, stages):
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    grid = (n // block_n, triton.cdiv(m, block_m))
    _skinny[grid](x, w, y, m, n, K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                  num_stages=stages)
    return y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,32,128")
    args = ap.parse_args()
    print(f"device {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}")
    print("| weight (K x N) | rows | cuBLAS us | cuBLAS TB/s | best Triton us | Triton TB/s | best tile (n, k, warps, stages) |")
    print("|---|---|---|---|---|---|---|")
    configs = list(itertools.product((16, 32, 64), (128, 256), (4,), (3, 4)))
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k ** 0.5
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            ref = F.linear(x, w)
            nbytes = w.numel() * 2 + x.numel() * 2 + ref.numel() * 2
            cublas = us_per_call(lambda _: F.linear(x, w), 20, replays=20)
            best = (float("inf"), None)
            for cfg in configs:
                try:
                    out = skinny(x, w, *cfg)
                except Exception:  # a tile that does not fit (shared memory, registers)
                    continue
                if not torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2):
                    print(f"wrong result for {name} {m} {cfg}: skipped", flush=True)
                    continue
                best = min(best, (us_per_call(lambda _: skinny(x, w, *cfg), 20, replays=20), cfg))
            print(f"| {name} ({k} x {n}) | {m} | {cublas:.2f} | {nbytes / cublas / 1e6:.2f} | {best[0]:.2f} | "
                  f"{nbytes / best[0] / 1e6:.2f} | {best[1]} |", flush=True)


if __name__ == "__main__":
    main()
