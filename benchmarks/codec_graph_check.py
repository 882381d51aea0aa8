"""Does the codec's graph runner give what its eager runner gives, on this device? Exit 1 where it does not.

Two CodecRunners on the device, each with a decoder of its own (same random weights: a tiny codec by default):
one with CUDA graphs (every (batch, frames) bucket of --batches x the streaming chunk sizes, the server's warm-up),
one eager. Random calls (rows on random slots, chunk lengths of the streaming schedule and odd final ones, streams
restarting now and then) go through both; every chunk's samples and every started slot's state are compared,
relative to the eager values' largest magnitude. Calls mix chunk lengths as served ones do, so on CUDA the
vocoder's kernels skip the tiles past each row's frames while the eager runner's shapes have less padding: what a
skipped tile would have held must not reach any row's samples or carried state. On an H100 in float32 the graphs'
shapes alone moved samples by up to 2.2e-3.

It found a call split in two replays (since removed) overwriting the first one's output (CUDA graphs of one memory
pool): the shorter chunks came back 3-16x off (docs/performance.md, twenty-fourth pass). On a CPU nothing is
captured (the buckets run eagerly), so it checks the logic only.

    python3 benchmarks/codec_graph_check.py                  # CUDA
    .venv/bin/python benchmarks/codec_graph_check.py --device cpu
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.codec_graph_bench import random_decoder  # noqa: E402
from serving.engine.codec_graphs import make_frame_buckets  # noqa: E402
from serving.engine.codec_stage import CodecChunk, CodecRunner  # noqa: E402
from serving.model.codec_config import released_codec_config, tiny_codec_config  # noqa: E402

PLAN = (2, 4, 8, 16, 25)  # the served schedule's chunk sizes (first chunk 2, steady 25)


def relative(got: torch.Tensor | np.ndarray, want: torch.Tensor | np.ndarray) -> float:
    got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-9))


def random_calls(rng: np.random.Generator, slots: int, steps: int, q: int, codebook: int):
    """Calls of chunks on distinct slots: each slot's first chunk starts it afresh (so every slot compared holds
    what its stream decoded), one in ten restarts it."""
    started: set[int] = set()
    for _ in range(steps):
        chunks = []
        for slot in sorted(rng.choice(slots, size=int(rng.integers(1, slots + 1)), replace=False).tolist()):
            n = int(rng.choice(PLAN + (25, 25))) if rng.random() > 0.2 else int(rng.integers(1, 26))
            first = slot not in started or rng.random() < 0.1
            started.add(slot)
            chunks.append(CodecChunk(slot, rng.integers(0, codebook, size=(n, q)).astype(np.int64), first))
        yield chunks, sorted(started)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--released", action="store_true", help="the released codec's size (default: the tiny one)")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--batches", default="1,2,4,8", help="graph batch buckets")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tolerance", type=float, default=1e-2, help="largest relative difference that passes")
    ap.add_argument("--verbose", action="store_true", help="every chunk and slot over the tolerance")
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    cfg = (released_codec_config() if args.released else tiny_codec_config()).decoder
    decoder = random_decoder(cfg).to(device, dtype)
    eager_decoder = copy.deepcopy(decoder)  # before either runner installs its kernels into its decoder
    q = cfg.num_quantizers
    buckets = tuple((b, f) for b in map(int, args.batches.split(",")) for f in make_frame_buckets(PLAN[0], PLAN[-1]))
    graphs = CodecRunner(decoder, device, q, args.slots, graph_buckets=buckets)
    graphs.warmup(PLAN)
    eager = CodecRunner(eager_decoder, device, q, args.slots)
    worst_samples = worst_state = 0.0
    rng = np.random.default_rng(0)
    for step, (chunks, started) in enumerate(random_calls(rng, args.slots, args.steps, q, cfg.codebook_size)):
        got, want = graphs.decode(chunks), eager.decode(chunks)
        for chunk, g, w in zip(chunks, got, want):
            if g.shape != w.shape:
                print(f"step {step}: slot {chunk.slot} has {g.shape} samples, eager {w.shape}")
                return 1
            err = relative(g, w)
            worst_samples = max(worst_samples, err)
            if args.verbose and err > args.tolerance:
                print(f"step {step}: slot {chunk.slot}, {len(chunk.codes)} frames: samples off by {err:.1e}")
        for name in ("state", "history"):
            mine, theirs = getattr(graphs.pool, name)[started], getattr(eager.pool, name)[started]
            worst_state = max(worst_state, relative(mine, theirs))
    ok = max(worst_samples, worst_state) <= args.tolerance
    print(f"{args.steps} calls; largest relative difference from eager: samples "
          f"{worst_samples:.2e}, slot states {worst_state:.2e} -> {'OK' if ok else 'MISMATCH'} "
          f"(tolerance {args.tolerance:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
