"""Which BLAS path runs the code predictor's products fastest at 16-128 rows, 0.6B shapes.

The wide layers' four products a pass (qkv, gate_up, o, down) run at ~1.4 TB/s of weights on an H100 (cuBLAS's
heuristic pick, 5.7-7.5 us a call at 16-128 rows against 2.7-4.2 us at the HBM floor; docs/performance.md).
This times each product, every call on its own weight (from HBM, as in a frame), 20 calls in a CUDA graph, as
F.linear on the (N, K) weight and as a product with the weight prepacked (K, N), each through
cuBLAS (torch's default), cuBLASLt (torch.backends.cuda.preferred_blas_library) and TunableOp (torch.cuda.tunable:
each shape timed over its candidate implementations once, the fastest kept), and checks each result.

    python benchmarks/blas_choice_bench.py [--rows 16,32,64,128]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from graph_timing import us_per_call

CALLS = 20
ROLES = {"qkv": (1024, 4096), "gate_up": (1024, 6144), "o": (2048, 1024), "down": (3072, 1024)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="16,32,64,128")
    ap.add_argument("--tunable-file", default="/tmp/tunableop_results.csv")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    dev = torch.device("cuda")
    print(f"device {torch.cuda.get_device_name()}; torch {torch.__version__}")
    data = {}
    for role, (k, n) in ROLES.items():
        w = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) / k ** 0.5 for _ in range(CALLS)]
        data[role] = (w, [x.t().contiguous() for x in w])
    paths = {"linear (N, K)": lambda x, w, wt: F.linear(x, w), "mm (K, N)": lambda x, w, wt: torch.mm(x, wt)}
    cells: dict[tuple[str, int], dict[str, float]] = {}

    def measure(library: str) -> None:
        for role, (w, wt) in data.items():
            for m in rows:
                x = torch.randn(m, w[0].shape[1], dtype=torch.bfloat16, device=dev)
                want = F.linear(x.float(), w[0].float())
                for name, path in paths.items():
                    got = path(x, w[0], wt[0]).float()
                    err = ((got - want).abs().max() / want.std()).item()
                    us = us_per_call(lambda i: path(x, w[i], wt[i]), CALLS)
                    cells.setdefault((role, m), {})[f"{name} {library}"] = us
                    if err > 0.05:
                        print(f"{role} {m} {name} {library}: error {err:.4f} of the spread", flush=True)

    measure("cublas")
    torch.backends.cuda.preferred_blas_library("cublaslt")
    measure("cublaslt")
    torch.backends.cuda.preferred_blas_library("cublas")
    torch.cuda.tunable.enable(True)
    torch.cuda.tunable.tuning_enable(True)
    torch.cuda.tunable.set_filename(args.tunable_file)
    torch.cuda.tunable.set_max_tuning_duration(200)
    for role, (w, wt) in data.items():  # tune outside graph capture
        for m in rows:
            x = torch.randn(m, w[0].shape[1], dtype=torch.bfloat16, device=dev)
            for path in paths.values():
                path(x, w[0], wt[0])
    torch.cuda.synchronize()
    torch.cuda.tunable.tuning_enable(False)
    measure("tunableop")
    torch.cuda.tunable.enable(False)
    columns = list(next(iter(cells.values())))
    print("\n| role | rows | " + " | ".join(columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for (role, m), row in cells.items():
        print(f"| {role} | {m} | " + " | ".join(f"{row[c]:.2f}" for c in columns) + " |")
    print("\n| rows | " + " | ".join(columns) + " | (sum of the four products, us) |")
    print("|---|" + "---|" * len(columns) + "|")
    for m in rows:
        sums = [sum(cells[(role, m)][c] for role in ROLES) for c in columns]
        print(f"| {m} | " + " | ".join(f"{s:.1f}" for s in sums) + " | |")
    try:
        print("\ntunableop results:")
        for line in torch.cuda.tunable.get_results():
            print(" ", line)
    except Exception as exc:  # noqa: BLE001 - a report, not a failure
        print("tunableop results unavailable:", exc)


if __name__ == "__main__":
    main()
