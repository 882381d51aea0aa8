"""The code predictor's products at 16-128 rows: cuBLAS and the compiled wide layers against the fused layers'
Triton kernels (serving/engine/triton_layers.py) with taller tiles, 0.6B shapes.

A frame of 32-128 rows runs the code predictor's 75 layer passes through WideStack: per pass four cuBLAS
products with Inductor's norm, SiLU and residual kernels between them (~55% of a 128-row frame's kernel time in
the H100 profiles, 2.4 GB of weights a frame read at ~1.2 TB/s). This times, per role and row count, each call
on its own weight (so the weights come from HBM, as in a frame), 20 calls in a CUDA graph:
- `cublas`: F.linear alone (less work than the layer needs),
- `wide`: what WideStack runs for the role (torch.compile of the norm + product, product + residual, or norm +
  gate/up product + SiLU * up),
- the fused layers' kernels (norm_matmul / matmul_residual) over one tile of all the call's rows, for each tile
  of a sweep, with the input rows (`rows`) or the weight's rows (`swap`) on the MMA's tall side;
checks each kernel's output against float32 maths, and prints one table per role plus the layer's sum.

    python benchmarks/wide_products_bench.py [--rows 16,32,64,128] [--roles qkv,gate_up,o,down]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
from graph_timing import us_per_call

from serving.engine import triton_layers

CALLS = 20
EPS = 1e-6
# role: (K, N of one output), 0.6B code predictor; gate_up's weight holds 2 N rows
ROLES = {"qkv": (1024, 4096), "gate_up": (1024, 3072), "o": (2048, 1024), "down": (3072, 1024)}
# (weight rows per program, K step, warps, stages)
TILES = {False: [(16, 256, 4, 4), (32, 128, 4, 3), (32, 128, 4, 4), (32, 256, 4, 3), (64, 64, 4, 4),
                 (64, 128, 4, 3), (64, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 3)],
         True: [(32, 128, 4, 4), (64, 64, 4, 5), (64, 128, 4, 3), (64, 128, 4, 4), (64, 256, 4, 3),
                (128, 64, 4, 4), (128, 128, 8, 3)]}
SMEM = 220 * 1024


def norm_kind(role: str) -> bool:
    return role in ("qkv", "gate_up")


def torch_role(role: str):
    """What the wide layers run for the role (serving/engine/triton_layers._project and _layer_tail's parts)."""
    if role == "qkv":
        return lambda x, w, norm, res: F.linear(F.rms_norm(x, (x.shape[-1],), norm, EPS), w)
    if role == "gate_up":
        def gate_up(x, w, norm, res):
            gate, up = F.linear(F.rms_norm(x, (x.shape[-1],), norm, EPS), w).chunk(2, dim=-1)
            return F.silu(gate) * up
        return gate_up
    return lambda x, w, norm, res: res + F.linear(x, w)


def reference(role: str, x, w, norm, res) -> torch.Tensor:
    return torch_role(role)(x.float(), w.float(), norm.float(), res.float())


def launch(role: str, x, w, norm, res, out, tile, swap: bool) -> None:
    m, k = x.shape
    n = out.shape[1]
    block_n, block_k, warps, stages = tile
    common = dict(BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k, DOT=True,
                  DOT_F32=False, PDL=False, SWAP=swap, num_warps=warps, num_stages=stages)
    grid = (triton.cdiv(n, block_n),)
    if norm_kind(role):
        triton_layers._norm_matmul_kernel[grid](x, x.stride(0), norm, w, out, m, k, n, EPS,
                                                GATED=role == "gate_up", **common)
    else:
        triton_layers._matmul_residual_kernel[grid](x, w, res, out, m, k, n, **common)


def fits(role: str, m: int, tile, swap: bool) -> bool:
    block_n, block_k, _, stages = tile
    weights = 2 if role == "gate_up" else 1
    return stages * (max(16, triton.next_power_of_2(m)) + weights * block_n) * block_k * 2 <= SMEM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="16,32,64,128")
    ap.add_argument("--roles", default="qkv,gate_up,o,down")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    dev = torch.device("cuda")
    print(f"device {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}")
    layer = {m: {"cublas": 0.0, "wide": 0.0, "best": 0.0} for m in rows}
    for role in args.roles.split(","):
        k, n = ROLES[role]
        rows_w = 2 * n if role == "gate_up" else n
        weights = [torch.randn(rows_w, k, dtype=torch.bfloat16, device=dev) / k ** 0.5 for _ in range(CALLS)]
        norm = (1 + 0.1 * torch.randn(k, device=dev)).to(torch.bfloat16)
        compiled = torch.compile(torch_role(role), dynamic=False)
        print(f"\n### {role}: K {k}, N {rows_w}\n")
        print("| rows | cublas us | wide us | best rows-tile us (tile) | best swap-tile us (tile) | max err / std |")
        print("|---|---|---|---|---|---|", flush=True)
        for m in rows:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            res = torch.randn(m, n, dtype=torch.bfloat16, device=dev)
            out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
            want = reference(role, x, weights[0], norm, res)
            cublas = us_per_call(lambda i: F.linear(x, weights[i]), CALLS)
            wide = us_per_call(lambda i: compiled(x, weights[i], norm, res), CALLS)
            best = {}
            worst_err = 0.0
            for swap, tiles in TILES.items():
                for tile in tiles:
                    if not fits(role, m, tile, swap):
                        continue
                    try:
                        launch(role, x, weights[0], norm, res, out, tile, swap)
                        err = ((out.float() - want).abs().max() / want.std()).item()
                        us = us_per_call(lambda i: launch(role, x, weights[i], norm, res, out, tile, swap), CALLS)
                    except Exception as exc:  # a tile the compiler rejects
                        print(f"{role} {m} {'swap' if swap else 'rows'} {tile}: {type(exc).__name__}: "
                              f"{str(exc)[:120]}", flush=True)
                        continue
                    worst_err = max(worst_err, err)
                    if swap not in best or us < best[swap][0]:
                        best[swap] = (us, tile)
            cells = [f"{best[s][0]:.2f} {best[s][1]}" if s in best else "-" for s in (False, True)]
            print(f"| {m} | {cublas:.2f} | {wide:.2f} | {cells[0]} | {cells[1]} | {worst_err:.4f} |", flush=True)
            layer[m]["cublas"] += cublas
            layer[m]["wide"] += wide
            layer[m]["best"] += min(v[0] for v in best.values())
    print("\n### a layer's four products (sum)\n")
    print("| rows | cublas us | wide us | best Triton us | wide / best | x 75 passes: ms saved a frame |")
    print("|---|---|---|---|---|---|")
    for m, t in layer.items():
        print(f"| {m} | {t['cublas']:.1f} | {t['wide']:.1f} | {t['best']:.1f} | {t['wide'] / t['best']:.2f} | "
              f"{75 * (t['wide'] - t['best']) / 1e3:.2f} |", flush=True)


if __name__ == "__main__":
    main()
