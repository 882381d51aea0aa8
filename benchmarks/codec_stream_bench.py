"""Codec time per generated frame: re-decoding left context for every chunk vs the incremental decoder.

At the released decoder size (random weights from the codec's own init), one stream of `--frames` frames is
decoded chunk by chunk as the engine streams it (a first chunk of `--first-chunk`, then `--chunk`) both ways:
  re-decode:    each chunk is decoded together with up to L earlier frames (decode_chunk), C + min(L, start)
                frames of work per C frames of audio (the engine's former codec stage: L = 72, C = 25);
  incremental:  each chunk decodes only its own frames, with every layer's state carried from the last chunk
                (serving/model/codec_stream.py).
The two alternate chunk by chunk, so machine load hits both alike; each chunk's time is the median over
`--repeats` runs of the whole stream. The incremental output equals the one-shot decode, so the table also
gives how far the L-frame re-decode is from it (max abs sample difference), which grows once a stream is
longer than L frames. A second table times priming a stream with `--reference` voice-clone codes.

    .venv/bin/python benchmarks/codec_stream_bench.py                    # CPU, fp32, 4 then 25, L = 72
    .venv/bin/python benchmarks/codec_stream_bench.py --device cuda --dtype bfloat16 --batch 8 --repeats 5
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from serving.model.codec_config import released_codec_config  # noqa: E402
from serving.model.codec_decoder import CodecDecoder, chunk_schedule, init_random_  # noqa: E402
from serving.model.codec_stream import IncrementalCodecDecoder  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=129, help="stream length (4 + 5 x 25: two chunks at full context)")
    parser.add_argument("--first-chunk", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=25)
    parser.add_argument("--left-context", type=int, default=72, help="frames re-decoded before each chunk")
    parser.add_argument("--reference", type=int, default=72,
                        help="voice-clone reference frames that prime a stream (0: skip that measurement)")
    parser.add_argument("--batch", type=int, default=1, help="identical-schedule streams decoded together")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()
    if min(args.frames, args.first_chunk, args.chunk, args.batch, args.repeats) < 1 or args.left_context < 0:
        parser.error("frames, chunk sizes, batch and repeats must be >= 1 and the left context >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)

    decoder = CodecDecoder(released_codec_config().decoder).eval()
    init_random_(decoder, torch.Generator().manual_seed(0))
    decoder = decoder.to(device=device, dtype=dtype)
    b = args.batch
    codes = torch.randint(0, decoder.config.codebook_size, (b, args.frames, decoder.config.num_quantizers),
                          generator=torch.Generator().manual_seed(1)).to(device)
    pool = IncrementalCodecDecoder(decoder, num_slots=b)
    slots = torch.arange(b, device=device)
    plan = chunk_schedule(args.frames, args.first_chunk, args.chunk, args.left_context)

    def redecode(context_start, start, end):
        with torch.inference_mode():
            return decoder.decode_chunk(codes[:, context_start:end], start - context_start)

    def incremental(context_start, start, end):
        return pool.step(codes[:, start:end], slots, torch.full((b,), end - start, device=device),
                         torch.full((b,), start == 0, device=device))

    redecode(*plan[0]), incremental(*plan[0])  # warm-up (allocations, kernel selection), not counted
    times = {"re-decode": [[] for _ in plan], "incremental": [[] for _ in plan]}
    deviation = [0.0] * len(plan)
    for _ in range(args.repeats):
        for i, chunk in enumerate(plan):
            outs = {}
            for name, fn in (("re-decode", redecode), ("incremental", incremental)):
                _sync(device)
                t0 = time.perf_counter()
                outs[name] = fn(*chunk)
                _sync(device)
                times[name][i].append(time.perf_counter() - t0)
            deviation[i] = float((outs["re-decode"].float() - outs["incremental"].float()).abs().max())

    print(f"# codec_stream_bench {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; device {device} "
          f"({platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads); released decoder size, random weights, {args.dtype}; batch {b}; chunks "
          f"{args.first_chunk} then {args.chunk}; left context {args.left_context}; median of {args.repeats}")
    print("| chunk (frames) | re-decoded frames | re-decode ms/frame | incremental ms/frame | ratio "
          "| max abs dev, re-decode vs exact |")
    print("|---|---|---|---|---|---|")
    total = {"re-decode": 0.0, "incremental": 0.0}
    for (context_start, start, end), dev, *per_name in zip(plan, deviation, *times.values()):
        med = dict(zip(times, (statistics.median(t) for t in per_name)))
        for name in total:
            total[name] += med[name]
        ms = {name: 1000 * t / ((end - start) * b) for name, t in med.items()}
        print(f"| {start}-{end} ({end - start}) | {end - context_start} | {ms['re-decode']:.1f} | "
              f"{ms['incremental']:.1f} | {ms['re-decode'] / ms['incremental']:.2f}x | {dev:.1e} |")
    ms = {name: 1000 * t / (args.frames * b) for name, t in total.items()}
    print(f"| whole stream ({args.frames}) | {sum(e - cs for cs, _, e in plan)} | {ms['re-decode']:.1f} | "
          f"{ms['incremental']:.1f} | {ms['re-decode'] / ms['incremental']:.2f}x | |")
    if args.reference:
        print_priming(pool, codes, args)


def print_priming(pool: IncrementalCodecDecoder, codes: torch.Tensor, args) -> None:
    """A cloned stream starts from its reference codes: decoding them as a first chunk (samples dropped) vs
    prime(), which runs the convolutions after the transformer over their last frames only."""
    device = codes.device
    refs = [(slot, codes[slot, : args.reference]) for slot in range(args.batch)]
    ways = {"decode as first chunk": lambda: pool.decode([(slot, ref, True) for slot, ref in refs]),
            "prime()": lambda: pool.prime(refs)}
    times = {name: [] for name in ways}
    for round_ in range(args.repeats + 1):  # round 0 warms up
        for name, fn in ways.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            if round_:
                times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"\npriming {args.reference} reference frames x batch {args.batch} (vocoder over the last "
          f"{pool.decoder.vocoder_receptive_frames} with prime()):")
    print("| way | ms | ratio |\n|---|---|---|")
    for name, t in med.items():
        print(f"| {name} | {1000 * t:.0f} | {med['decode as first chunk'] / t:.2f}x |")


if __name__ == "__main__":
    main()
