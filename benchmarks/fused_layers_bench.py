"""Tiles for the fused Triton decoder layers (serving/engine/triton_layers.py: code predictor and talker), 0.6B shapes.

For each matrix-product role of a fused layer and each row count a frame's code predictor passes (1 to 16), times
every tile of a small sweep against cuBLAS's plain product (F.linear, which does less: no norm, no epilogue), 20
calls in a CUDA graph, each call on its own weight (so, as in a frame, the weights come from HBM, not L2); and
the attention kernel over the code predictor's cache, for each (query heads per program, warps) at 1 to 128 rows.
Prints tables and the best tile per role, and the best attention launch for the wide layers (over MAX_ROWS rows);
a measurement to choose triton_layers._TILES. First it compares the fused and wide stacks' logits with the torch
stacks' in bfloat16 (see agreement), and the fused layers with and without programmatic dependent launch (see
pdl_check).

    python benchmarks/fused_layers_bench.py [--rows 1,2,4,8,16] [--json TILES.json] [--agreement-only]
        [--attention-only]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from graph_timing import us_per_call

from serving.engine import triton_layers
from serving.model.config import TransformerConfig
from serving.model.layers import Attention, DecoderStack, KVCache, RotaryTable, apply_rope, attention_mask

CALLS = 20
# role: (K, N of the weight, the call), 0.6B code predictor
ROLES = {"qkv": (1024, 4096), "gate_up": (1024, 2 * 3072), "o": (2048, 1024), "down": (3072, 1024),
         "head": (1024, 2048)}


def stack_config(layers: int, positions: int, vocab: int = 2048) -> TransformerConfig:
    """A 0.6B decoder stack's shapes (the code predictor's and the talker's layers are alike)."""
    return TransformerConfig(hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
                             num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                             rope_theta=1e6, max_position_embeddings=positions, vocab_size=vocab)


def run(role: str, x: torch.Tensor, w: torch.Tensor, norm: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    if role in ("o", "down"):
        return triton_layers.matmul_residual(x, w, residual, role)
    return triton_layers.norm_matmul(x, norm, 1e-6, w, role, gated=role == "gate_up")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--json", help="write the best tile per role here (decode_bench.py --tiles reads it)")
    ap.add_argument("--agreement-only", action="store_true",
                    help="only compare the fused stacks with the torch ones, and PDL on and off")
    ap.add_argument("--attention-only", action="store_true",
                    help="only the agreement and the attention launches (--json: the wide layers' best)")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    dev = torch.device("cuda")
    print(f"device {torch.cuda.get_device_name()}; torch {torch.__version__}")
    agreement(dev)
    if args.attention_only:
        best = attention_launches(dev)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"attention": {"wide": best}}, f)
        return
    pdl_check(dev)
    if args.agreement_only:
        return
    tiles = {"dot": list(itertools.product((16, 32, 64), (128, 256), (4,), (3, 4))),
             "gemv": list(itertools.product((1, 2, 4, 8), (512, 1024, 2048), (2, 4, 8), (3,)))}
    print("| role (K x N) | rows | cuBLAS us | fused, current tile us | best tile us | best tile (n, k, warps, stages) |")
    print("|---|---|---|---|---|---|")
    best_by_role = {}
    for role, (k, n) in ROLES.items():
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) / k ** 0.5 for _ in range(CALLS)]
        norm = torch.ones(k, dtype=torch.bfloat16, device=dev)
        totals = {kind: {t: 0.0 for t in kind_tiles} for kind, kind_tiles in tiles.items()}
        for m in rows:
            kind = "gemv" if m <= triton_layers.GEMV_ROWS else "dot"
            current = triton_layers._TILES[role][kind]
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            residual = torch.zeros(m, n, dtype=torch.bfloat16, device=dev)  # made once: no fill kernel in the timing
            cublas = us_per_call(lambda i: F.linear(x, weights[i]), CALLS)
            timed = {}
            for tile in tiles[kind]:
                if kind == "gemv" and m * tile[0] * tile[1] > 8192:
                    totals[kind][tile] = float("inf")  # float32 products that would not fit in registers
                    continue
                triton_layers._TILES[role][kind] = tile
                try:
                    timed[tile] = us_per_call(lambda i: run(role, x, weights[i], norm, residual), CALLS)
                except Exception as exc:  # a tile that does not fit
                    print(f"{role} {tile}: {type(exc).__name__}", flush=True)
                    timed[tile] = float("inf")
                totals[kind][tile] += timed[tile]
            triton_layers._TILES[role][kind] = current
            best = min(timed, key=timed.get)
            print(f"| {role} ({k} x {n}) | {m} | {cublas:.2f} | {timed.get(current, float('nan')):.2f} | "
                  f"{timed[best]:.2f} | {kind} {best} |", flush=True)
        best_by_role[role] = {kind: min(t, key=t.get) for kind, t in totals.items()
                              if any(0 < v < float("inf") for v in t.values())}
    print("best tile over the row counts:", best_by_role, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(best_by_role, f)

    attention_launches(dev)


def attention_launches(dev: torch.device) -> tuple[int, int]:
    """us per call of the attention kernel over the code predictor's 16-position cache (q/k norm, rotary, cache
    write, attention) for each (query heads per program, warps), and of what the compiled modules run instead
    (SDPA after their own norm, rotary and cache writes, the "modules" column); returns the launch with the least
    total time over the calls of more than MAX_ROWS rows (the wide layers')."""
    attn = Attention(stack_config(1, 16)).to(dev, torch.bfloat16)
    rotary = RotaryTable(128, 1e6, 16).to(dev)
    launches = list(itertools.product((1, 2), (1, 2, 4, 8)))
    saved = triton_layers._TILES["attention"].copy()

    def modules(qkv, batch, seq, pos, k, v, kv_len):  # Attention.forward between its projections
        q, kk, vv = qkv.view(batch, seq, -1).split([16 * 128, 8 * 128, 8 * 128], dim=-1)
        q = attn.q_norm(q.view(batch, seq, 16, 128)).transpose(1, 2)
        kk = attn.k_norm(kk.view(batch, seq, 8, 128)).transpose(1, 2)
        cos, sin = rotary(pos, qkv.dtype)
        q, kk = apply_rope(q, cos, sin), apply_rope(kk, cos, sin)
        rows = torch.arange(batch, device=dev)[:, None]
        k[rows, :, pos] = kk.transpose(1, 2)
        v[rows, :, pos] = vv.reshape(batch, seq, 8, 128)
        return F.scaled_dot_product_attention(q, k[:, :, :kv_len], v[:, :, :kv_len], scale=attn.scale,
                                              enable_gqa=True)

    compiled = torch.compile(modules, dynamic=True)
    print("| attention: batch x positions | modules us | " + " | ".join(f"{h} heads, {w} warps" for h, w in launches)
          + " |")
    print("|---|---|" + "---|" * len(launches))
    totals = dict.fromkeys(launches, 0.0)
    for batch, seq in ((1, 2), (1, 1), (8, 1), (8, 2), (16, 1), (32, 1), (32, 2), (64, 1), (128, 1), (128, 2)):
        qkv = torch.randn(batch * seq, 32 * 128, dtype=torch.bfloat16, device=dev)
        k = torch.zeros(batch, 8, 16, 128, dtype=torch.bfloat16, device=dev)
        v = torch.zeros_like(k)
        first = 0 if seq == 2 else 9
        pos = torch.arange(seq, device=dev).expand(batch, seq) + first
        with torch.inference_mode():
            base = us_per_call(lambda i: compiled(qkv, batch, seq, pos, k, v, first + seq), CALLS)
            cells = []
            for launch in launches:
                triton_layers._TILES["attention"] = {"few": launch, "wide": launch}
                us = us_per_call(lambda i: triton_layers.attention(qkv, attn, rotary.cos, rotary.sin, pos, k, v),
                                 CALLS)
                cells.append(f"{us:.2f}")
                if batch * seq > triton_layers.MAX_ROWS:
                    totals[launch] += us
        print(f"| {batch} x {seq} | {base:.2f} | " + " | ".join(cells) + " |", flush=True)
    triton_layers._TILES["attention"] = saved
    best = min(totals, key=totals.get)
    print(f"best launch over {triton_layers.MAX_ROWS} rows (query heads per program, warps): {best}", flush=True)
    return best


def pdl_check(dev: torch.device) -> None:
    """Programmatic dependent launch changes when a kernel starts, never what it computes: a fused stack's pass
    (the 0.6B talker's 28 layers over a 1024-position cache, the code predictor's 5 over 16) captured in a CUDA
    graph with triton_layers.PDL off and on must give bit-identical outputs and caches; and its time per pass
    (PDL applies to calls of up to PDL_ROWS rows)."""
    before = triton_layers.PDL
    print("| stack | rows | PDL | us per pass | identical to off |")
    print("|---|---|---|---|---|")
    for name, layers, cache_len in (("talker", 28, 1024), ("code predictor", 5, 16)):
        cfg = stack_config(layers, cache_len)
        torch.manual_seed(0)
        fused = triton_layers.FusedStack(DecoderStack(cfg, max_positions=cache_len).to(dev, torch.bfloat16))
        for batch in (1, 2, 4):
            cache = KVCache.for_stack(cfg, batch, cache_len, torch.bfloat16, dev)
            cache.k.normal_(), cache.v.normal_()
            pos = torch.randint(1, cache_len - 1, (batch, 1), device=dev)
            x = torch.randn(batch, 1, 1024, dtype=torch.bfloat16, device=dev)
            off = None
            for on in (False, True, False, True):
                triton_layers.PDL = on
                k, v = cache.k.clone(), cache.v.clone()
                with torch.inference_mode():
                    us = us_per_call(lambda i: fused(x, pos, k, v), CALLS)
                    out = (fused(x, pos, k, v), k, v)
                off = off or out
                same = "yes" if all(torch.equal(a, b) for a, b in zip(off, out)) else "NO"
                print(f"| {name} | {batch} | {'on' if on else 'off'} | {us:.1f} | {same} |", flush=True)
    triton_layers.PDL = before


def agreement(dev: torch.device) -> None:
    """On the GPU in bfloat16 the fused kernels round differently from cuBLAS and the compiled modules (sums in
    another order), so their logits differ by bfloat16 noise. For the 0.6B code predictor (a frame's 15 passes;
    the fused layers at 1-8 rows, the compiled wide layers at 32 and 128) and the 0.6B talker (15 steps over a
    1024-position cache whose rows are at positions 100-600), random weights and the same inputs: the largest
    logit difference against the logits' spread, and how often both pick the same top code."""
    print("| stack | rows | passes | max logit difference / logit std | same top code |")
    print("|---|---|---|---|---|")
    for name, layers, cache_len, vocab in (("code predictor", 5, 16, 2048), ("talker", 28, 1024, 3072)):
        cfg = stack_config(layers, cache_len, vocab)
        torch.manual_seed(0)
        stack = DecoderStack(cfg, max_positions=cache_len).to(dev, torch.bfloat16)
        head = torch.nn.Linear(1024, vocab, bias=False).to(dev, torch.bfloat16)
        fused = triton_layers.FusedStack(stack)
        talker = name == "talker"
        wide = triton_layers.WideStack(stack)
        wide.compile()
        runs = [("fused", batch) for batch in (1, 4, 8)] + ([] if talker else [("wide", 32), ("wide", 128)])
        for kind, batch in runs:
            cache = KVCache.for_stack(cfg, batch, cache_len, torch.bfloat16, dev)
            if talker:  # the rows' earlier positions: a prompt's and earlier frames' keys and values
                cache.k.normal_(), cache.v.normal_()
                pos = torch.randint(100, 600, (batch, 1), device=dev)
            else:
                pos = torch.arange(2, device=dev).expand(batch, 2)
            k, v = cache.k.clone(), cache.v.clone()
            x = torch.randn(batch, pos.shape[1], 1024, dtype=torch.bfloat16, device=dev)
            worst, same, total = 0.0, 0, 0
            with torch.inference_mode():
                for _ in range(15):
                    if talker:
                        mask = attention_mask(pos, torch.arange(cache_len, device=dev)[None, :] <= pos)
                        out = stack(x, pos, cache, pos, kv_len=cache_len, mask=mask)
                    else:
                        out = stack(x, pos, cache, pos, kv_len=int(pos[0, -1]) + 1, mask=None)
                    want = head(out[:, -1]).float()
                    if kind == "fused":
                        got = fused.head(fused(x, pos, k, v)[:, -1], head.weight).float()
                    else:
                        got = head(stack.norm(wide(x, pos, k, v)[:, -1])).float()
                    worst = max(worst, ((got - want).abs().max() / want.std()).item())
                    same += (got.argmax(-1) == want.argmax(-1)).sum().item()
                    total += batch
                    x = torch.randn(batch, 1, 1024, dtype=torch.bfloat16, device=dev)
                    pos = pos[:, -1:] + 1
            print(f"| {name}{' (wide)' if kind == 'wide' else ''} | {batch} | 15 | {worst:.4f} | {same}/{total} |",
                  flush=True)


if __name__ == "__main__":
    main()
