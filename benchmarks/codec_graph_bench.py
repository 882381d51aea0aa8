"""Codec call time per (batch, frames) bucket: eager vs its CUDA graph, with each graph's memory.

At the released decoder size (random weights from the codec's own init), two CodecRunners share one decoder:
one eager, one with the graphs the server captures (serving/engine/codec_graphs.py, every bucket of
--batches x the frames buckets of --first-chunk/--chunk, under --budget-gb when given). Each bucket's call is
what the server pays per codec step: `batch` streams in steady state (distinct slots, not first chunks) of
`frames` new frames each, host assembly, copies in, the step, one copy out. The two runners alternate call by
call, so machine load hits both alike; each cell is the median of --repeats calls. Graph memory is what the
capture added to the graphs' shared pool (plus static inputs); "eager peak" is what an eager call allocates at
its peak beyond the resident state, the estimate the budget uses.

    python3 benchmarks/codec_graph_bench.py --device cuda --json /tmp/codec_graphs.json
    python3 benchmarks/codec_graph_bench.py --device cuda --dtype bfloat16 --budget-gb 1
    .venv/bin/python benchmarks/codec_graph_bench.py --tiny --batches 1,2 --repeats 2   # CPU: logic only
On a CPU the "graph" column runs the captured function eagerly through padded static buffers (no graphs).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from serving.engine.codec_graphs import make_batch_buckets, make_frame_buckets, parse_batches  # noqa: E402
from serving.engine.codec_stage import CodecChunk, CodecRunner  # noqa: E402
from serving.model.codec_config import released_codec_config, tiny_codec_config  # noqa: E402
from serving.model.codec_decoder import CodecDecoder, init_random_  # noqa: E402
from serving.model.weights import resolve_dtype  # noqa: E402


def timed(runner: CodecRunner, chunks: list[CodecChunk], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    runner.decode(chunks)  # ends with a copy to the host: synchronous
    return (time.perf_counter() - start) * 1000


def eager_peak(runner: CodecRunner, chunks: list[CodecChunk], device: torch.device) -> int | None:
    """Bytes an eager call allocates at its peak beyond what was allocated before (None on a CPU)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    runner.decode(chunks)
    return torch.cuda.max_memory_allocated(device) - base


def random_decoder(cfg) -> CodecDecoder:
    decoder = CodecDecoder(cfg).eval()
    init_random_(decoder, torch.Generator().manual_seed(0))
    return decoder


def dtype_drift(decoder: CodecDecoder, cfg, device: torch.device, args) -> dict:
    """How far the --dtype decode of one stream is from float32 on the same weights (the quality question of
    --codec-dtype, as numerics; a listening or ASR check needs real weights)."""
    frames = args.first_chunk + 4 * args.chunk
    codes = np.random.default_rng(1).integers(0, cfg.codebook_size, (frames, cfg.num_quantizers))
    out = []
    for dec in (decoder, random_decoder(cfg).to(device)):  # the same weights, never rounded
        runner, start, pieces = CodecRunner(dec, device, cfg.num_quantizers, 1), 0, []
        while start < frames:
            n = min(args.first_chunk if start == 0 else args.chunk, frames - start)
            pieces.append(runner.decode([CodecChunk(0, codes[start:start + n], start == 0)])[0])
            start += n
        out.append(np.concatenate(pieces))
    low, ref = out
    err = low - ref
    snr = 10 * np.log10(float((ref ** 2).sum()) / max(float((err ** 2).sum()), 1e-30))
    return {"frames": frames, "max_abs": float(np.abs(err).max()), "snr_db": round(snr, 2)}


def profile_calls(eager: CodecRunner, graphs: CodecRunner, bucket: tuple[int, int], cfg, args) -> None:
    """Where a codec call's GPU time goes, by kernel: one eager call and one graph replay of `bucket`."""
    from torch.profiler import ProfilerActivity, profile

    b, f = bucket
    chunks = [CodecChunk(s, np.random.default_rng(s).integers(0, cfg.codebook_size, (f, cfg.num_quantizers)), False)
              for s in range(b)]
    with args.profile.open("a") as out:
        for name, runner in (("eager", eager), ("graph", graphs)):
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                runner.decode(chunks)
            out.write(f"=== codec {args.dtype}, {name} call, batch {b} x {f} frames ===\n")
            out.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=90))
            out.write("\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,2,4,8,16", help="batch buckets (the server's default ladder)")
    parser.add_argument("--first-chunk", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=25)
    parser.add_argument("--budget-gb", type=float, default=None, help="as --codec-graph-memory-gb")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--tiny", action="store_true", help="the tiny test codec (CPU smoke runs)")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    parser.add_argument("--profile", type=Path, default=None,
                        help="append the kernel table of one eager and one graph call of the largest bucket here")
    parser.add_argument("--cudnn-benchmark", action="store_true", help="let cuDNN time its convolution algorithms")
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = args.cudnn_benchmark

    device, dtype = torch.device(args.device), resolve_dtype(args.dtype)
    batches = parse_batches(args.batches) or ()
    max_batch = max(batches, default=1)
    frames = make_frame_buckets(args.first_chunk, args.chunk)
    buckets = tuple((b, f) for b in make_batch_buckets(max_batch, batches) for f in frames)
    cfg = (tiny_codec_config() if args.tiny else released_codec_config()).decoder
    decoder = random_decoder(cfg).to(device, dtype)
    q = cfg.num_quantizers
    eager = CodecRunner(decoder, device, q, max_batch)  # fused activations on CUDA, in place: both runners
    graphs = CodecRunner(decoder, device, q, max_batch, graph_buckets=buckets,
                         graph_budget_bytes=None if args.budget_gb is None else int(args.budget_gb * 1024**3))
    t0 = time.perf_counter()
    graphs.warmup((args.first_chunk, args.chunk))
    capture_s = time.perf_counter() - t0
    eager.warmup((args.first_chunk, args.chunk))
    report = graphs.graph_report
    memory = {(b, f): m for b, f, m in report.graphs}
    rng = np.random.default_rng(0)

    print(f"# codec graphs: {args.device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor()}), "
          f"torch {torch.__version__}, {'tiny' if args.tiny else 'released'} codec, {args.dtype}, "
          f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; capture {capture_s:.1f} s, "
          f"{len(report.graphs)} graphs, {report.total_bytes / 2**20:.0f} MiB"
          + (f", dropped {list(report.dropped)} (budget {args.budget_gb} GiB)" if report.dropped else ""))
    print("| batch | frames | eager ms | graph ms | speedup | graph MiB | eager peak MiB |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for b, f in sorted(buckets):
        for runner in (eager, graphs):  # every slot past its first chunk: steady-state streams
            runner.decode([CodecChunk(s, np.zeros((1, q), np.int64), True) for s in range(b)])
        chunks = lambda: [CodecChunk(s, rng.integers(0, cfg.codebook_size, (f, q)), False) for s in range(b)]  # noqa: E731
        peak = eager_peak(eager, chunks(), device)
        times = {"eager": [], "graph": []}
        for _ in range(args.repeats):
            batch = chunks()
            times["eager"].append(timed(eager, batch, device))
            times["graph"].append(timed(graphs, batch, device))
        e, g = statistics.median(times["eager"]), statistics.median(times["graph"])
        covered = graphs.graphs.covering(b, f) == (b, f)
        row = {"batch": b, "frames": f, "eager_ms": round(e, 3), "graph_ms": round(g, 3) if covered else None,
               "graph_memory_bytes": memory.get((b, f)), "eager_peak_bytes": peak}
        rows.append(row)
        mib = "-" if row["graph_memory_bytes"] is None else f"{row['graph_memory_bytes'] / 2**20:.1f}"
        print(f"| {b} | {f} | {e:.2f} | {f'{g:.2f}' if covered else 'eager (dropped)'} | "
              f"{f'{e / g:.1f}x' if covered else '-'} | {mib} | {'-' if peak is None else f'{peak / 2**20:.0f}'} |")
    if args.profile:
        profile_calls(eager, graphs, max(buckets), cfg, args)
    drift = dtype_drift(decoder, cfg, device, args) if dtype != torch.float32 else None
    if drift is not None:
        print(f"{args.dtype} vs float32, one {drift['frames']}-frame stream in chunks of {args.chunk}: max abs "
              f"{drift['max_abs']:.2e}, SNR {drift['snr_db']:.1f} dB (random weights: numerics only, not quality)")
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "dtype": args.dtype, "tiny": args.tiny,
                                         "torch": torch.__version__, "capture_s": round(capture_s, 2),
                                         "report": report.describe(), "rows": rows, "dtype_drift": drift}, indent=1) + "\n")


if __name__ == "__main__":
    main()
