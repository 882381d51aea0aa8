"""Each convolution of the codec's vocoder, cuDNN against the window-product kernel (serving/engine/triton_conv.py).

For every distinct convolution after the codec's transformer (released sizes: the two 1024-channel upsamplers,
the 1024 -> 1536 conv, the four blocks' transposed convs and residual units' k7 / k1 convs, the 96 -> 1 conv)
at each --calls shape (batch x frames), times:
  cudnn-ncl   F.conv1d / conv_transpose1d on (B, C, L) contiguous input, as the codec ran them before
              triton_vocoder installed the window products (cuDNN converts half-precision activations to
              channels-innermost and back inside the call);
  cudnn-nlc   the same on a (B, L, C) tensor viewed as (B, C, L);
  window      the Triton kernel on (B, L, C) with pick_blocks' tile, and `best` over a sweep of tiles;
plus a residual unit's whole work both ways (bench_unit). The weights are random; times are CUDA-event medians of --repeats.

    python3 benchmarks/vocoder_conv_bench.py --calls 1x25,16x25,64x25 --json /tmp/vocoder_conv.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from serving.engine import triton_conv, triton_vocoder  # noqa: E402
from serving.model.codec_config import released_codec_config  # noqa: E402

TILES = [(bm, bn, bk, w, s) for bm in (64, 128) for bn in (32, 64, 128) for bk in (32, 64)
         for w, s in ((4, 3), (8, 4))] + [(256, bn, 32, 8, s) for bn in (64, 128) for s in (2, 3)]


def layers(cfg, frames: int) -> list[dict]:
    """(name, kind, C, C_out, kernel, dilation / stride, input rows L) of each distinct ungrouped convolution of a
    codec decoder config's vocoder (CodecDecoder.vocode's order) for `frames`."""
    out, length, latent = [], frames, cfg.latent_dim
    for i, r in enumerate(cfg.upsampling_ratios):
        out.append(dict(name=f"upsample{i + 1} T {latent} r{r}", transposed=True, c=latent, co=latent, k=r, s=r,
                        L=length))
        length *= r
    c = cfg.decoder_dim
    out.append(dict(name=f"decoder0 {latent}->{c} k7", transposed=False, c=latent, co=c, k=7, s=1, L=length))
    for r in cfg.upsample_rates:
        out.append(dict(name=f"block r{r} T {c}->{c // 2}", transposed=True, c=c, co=c // 2, k=2 * r, s=r, L=length))
        c, length = c // 2, length * r
        for d in (1, 3, 9):
            out.append(dict(name=f"  unit {c} k7 d{d}", transposed=False, c=c, co=c, k=7, s=d, L=length))
        out.append(dict(name=f"  unit {c} k1", transposed=False, c=c, co=c, k=1, s=1, L=length))
    out.append(dict(name=f"final {c}->1 k7", transposed=False, c=c, co=1, k=7, s=1, L=length))
    return out


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def best_tile(run, n: int, c: int, repeats: int) -> tuple[float, tuple]:
    """(ms, tile) of the fastest tile of TILES that fits n columns and c channels a tap for run(blocks)."""
    best = None
    for blocks in TILES:
        if blocks[1] > max(32, 2 * n) or blocks[2] > max(32, c):
            continue
        try:
            ms = median_ms(lambda: run(blocks), max(5, repeats // 2))
        except Exception:  # a tile that needs more shared memory than the GPU has
            continue
        if best is None or ms < best[0]:
            best = (ms, blocks)
    return best


def bench_layer(spec: dict, batch: int, repeats: int, sweep: bool, dtype) -> dict:
    dev = "cuda"
    c, co, k, s, length = spec["c"], spec["co"], spec["k"], spec["s"], spec["L"]
    if spec["transposed"]:
        taps, dilation, phases = k // s, 1, s
        weight = torch.randn(c, co, k, device=dev, dtype=dtype) / (c * taps) ** 0.5
        matrix = triton_conv.transposed_matrix(weight, s)
    else:
        taps, dilation, phases = k, s, 1
        weight = torch.randn(co, c, k, device=dev, dtype=dtype) / (c * k) ** 0.5
        matrix = triton_conv.conv_matrix(weight)
    bias = torch.randn(co, device=dev, dtype=dtype) * 0.02
    history = (taps - 1) * dilation
    x_blc = torch.randn(batch, history + length, c, device=dev, dtype=dtype)
    x_bcl = x_blc.transpose(1, 2).contiguous()

    def cudnn(x):
        if spec["transposed"]:
            return F.conv_transpose1d(x, weight, bias, stride=s)
        return F.conv1d(x, weight, bias, dilation=dilation)

    row = dict(layer=spec["name"], batch=batch, rows=batch * length, c=c, n=matrix.shape[1], taps=taps,
               gflop=2.0 * batch * length * matrix.shape[0] * matrix.shape[1] / 1e9)
    row["cudnn_ncl"] = median_ms(lambda: cudnn(x_bcl), repeats)
    row["cudnn_nlc"] = median_ms(lambda: cudnn(x_blc.transpose(1, 2)), repeats)
    out = torch.empty(batch, length * phases, co, device=dev, dtype=dtype)
    run = lambda blocks=None: triton_conv.window_product(x_blc, matrix, bias, taps, dilation, phases, out=out,  # noqa: E731
                                                         blocks=blocks)
    row["window"] = median_ms(run, repeats)
    # the cuDNN output, cut as the causal transposed conv cuts it, against the kernel's
    want = cudnn(x_bcl)
    if spec["transposed"]:
        want = want[..., history * s: history * s + length * s]
    row["max_dev"] = float((out.transpose(1, 2).float() - want.float()).abs().max())
    if sweep:
        row["best"], row["best_blocks"] = best_tile(run, matrix.shape[1], c, repeats)
    return row


def bench_unit(c: int, length: int, batch: int, dilation: int, repeats: int, sweep: bool, dtype) -> dict:
    """A residual unit's whole work in (B, C, L) with cuDNN (SnakeBeta kernel, k7 conv, SnakeBeta kernel, k1 conv,
    addition) against the installed path (SnakeBeta into the history buffer, then two window products whose
    epilogues apply the second SnakeBeta and add the residual), with the installed path's pieces."""
    dev = "cuda"
    w1 = torch.randn(c, c, 7, device=dev, dtype=dtype) / (7 * c) ** 0.5
    w2 = torch.randn(c, c, 1, device=dev, dtype=dtype) / c ** 0.5
    b1, b2 = (torch.randn(c, device=dev, dtype=dtype) * 0.02 for _ in range(2))
    a1, be1, a2, be2 = (torch.randn(c, device=dev) * 0.1 for _ in range(4))
    m1, m2 = triton_conv.conv_matrix(w1), triton_conv.conv_matrix(w2)
    history = 6 * dilation
    x_bcl = torch.randn(batch, c, length, device=dev, dtype=dtype)
    full_bcl = torch.zeros(batch, c, history + length, device=dev, dtype=dtype)
    x_blc = x_bcl.transpose(1, 2).contiguous()
    full_blc = torch.zeros(batch, history + length, c, device=dev, dtype=dtype)
    h_blc = torch.randn(batch, length, c, device=dev, dtype=dtype)

    def cudnn():
        triton_vocoder.snake(x_bcl, a1, be1, out=full_bcl[..., history:])
        h = triton_vocoder.snake(F.conv1d(full_bcl, w1, b1, dilation=dilation), a2, be2)
        return x_bcl + F.conv1d(h, w2, b2)

    pieces = dict(
        snake=lambda: triton_vocoder.snake(x_blc.transpose(1, 2), a1, be1, out=full_blc[:, history:].transpose(1, 2)),
        k7=lambda: triton_conv.window_product(full_blc, m1, b1, 7, dilation),
        k7_snake=lambda: triton_conv.window_product(full_blc, m1, b1, 7, dilation, snake=(a2, be2)),
        k1=lambda: triton_conv.window_product(h_blc, m2, b2, 1),
        k1_residual=lambda: triton_conv.window_product(h_blc, m2, b2, 1, residual=x_blc))

    def window():
        pieces["snake"]()
        h = triton_conv.window_product(full_blc, m1, b1, 7, dilation, snake=(a2, be2))
        return triton_conv.window_product(h, m2, b2, 1, residual=x_blc)

    deviation = float((window().transpose(1, 2).float() - cudnn().float()).abs().max())
    row = dict(unit=f"unit {c} d{dilation}", batch=batch, length=length, cudnn=median_ms(cudnn, repeats),
               window=median_ms(window, repeats), max_dev=deviation,
               pieces={name: median_ms(fn, repeats) for name, fn in pieces.items()})
    if sweep:  # the epilogues change what fits in registers, so the products with them get their own sweep
        row["best_k7_snake"] = best_tile(lambda blocks: triton_conv.window_product(
            full_blc, m1, b1, 7, dilation, snake=(a2, be2), blocks=blocks), c, c, repeats)
        row["best_k1_residual"] = best_tile(lambda blocks: triton_conv.window_product(
            h_blc, m2, b2, 1, residual=x_blc, blocks=blocks), c, c, repeats)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", default="1x25,16x25,64x25", help="batch x frames of the codec calls")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--sweep", action="store_true", help="also time every tile of TILES, report the best")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    dtype = getattr(torch, args.dtype)
    rows, units = [], []
    print(f"{torch.cuda.get_device_name()} torch {torch.version.__version__} cuda {torch.version.cuda}")
    for call in args.calls.split(","):
        batch, frames = (int(v) for v in call.split("x"))
        total = {"cudnn_ncl": 0.0, "cudnn_nlc": 0.0, "window": 0.0, "best": 0.0}
        print(f"\n=== {batch} x {frames} frames, {args.dtype} ===")
        print(f"{'layer':28s} {'rows':>9s} {'GFLOP':>7s} {'cudnn NCL':>9s} {'cudnn NLC':>9s} {'window':>8s} "
              f"{'best':>8s} {'TFLOP/s':>7s} {'max dev':>8s} best tile")
        specs = layers(released_codec_config().decoder, frames)
        for spec in specs:
            row = bench_layer(spec, batch, args.repeats, args.sweep, dtype)
            row["call"] = call
            rows.append(row)
            for key in total:
                total[key] += row.get(key, 0.0) or 0.0
            best = row.get("best", row["window"])
            print(f"{row['layer']:28s} {row['rows']:9d} {row['gflop']:7.1f} {row['cudnn_ncl']:9.3f} "
                  f"{row['cudnn_nlc']:9.3f} {row['window']:8.3f} {best:8.3f} {row['gflop'] / best:7.0f} "
                  f"{row['max_dev']:8.1e} {row.get('best_blocks', '')}")
        print(f"{'sum':28s} {'':9s} {'':7s} {total['cudnn_ncl']:9.3f} {total['cudnn_nlc']:9.3f} "
              f"{total['window']:8.3f} {total['best'] or total['window']:8.3f}")
        for spec in (spec for spec in specs if spec["name"].endswith("k1")):  # one unit per block
            unit = bench_unit(spec["c"], spec["L"], batch, 3, args.repeats, args.sweep, dtype)
            unit["call"] = call
            units.append(unit)
            print(f"residual {unit['unit']:14s} cudnn {unit['cudnn']:8.3f} ms, window {unit['window']:8.3f} ms "
                  f"({unit['cudnn'] / unit['window']:.2f}x), max dev {unit['max_dev']:.1e}")
            print("    " + ", ".join(f"{name} {ms:.3f}" for name, ms in unit["pieces"].items()))
            if args.sweep:
                print(f"    best k7_snake {unit['best_k7_snake']}, best k1_residual {unit['best_k1_residual']}")
    if args.json:
        args.json.write_text(json.dumps(dict(layers=rows, units=units), indent=1))


if __name__ == "__main__":
    main()
