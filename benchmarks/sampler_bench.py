"""Time of one draw of the candidate sampler on a GPU: the torch version compiled (topk) vs the fused Triton kernel
at several warp counts and radix-select digit widths (RADIX_BITS), 16 draws captured in a CUDA graph (as in a
frame), by batch and vocabulary.

    python benchmarks/sampler_bench.py [--batches 1,32,128] [--warps 4,8,16] [--bits 1,2,4]
"""

from __future__ import annotations

import argparse

import torch
from graph_timing import us_per_call

from serving.engine import triton_sampling
from serving.engine.talker_stage import _torch_candidates
from serving.model.sampler import SamplingParams

DRAWS = 16


def time_draw(fn, logits, params, seed, frame) -> float:
    """Microseconds per draw, the DRAWS draws of a frame (groups 0..15) in one graph."""
    return us_per_call(lambda group: fn(logits, params, seed, frame, group), DRAWS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--warps", default="4,8,16")
    ap.add_argument("--bits", default="1,2,4")
    args = ap.parse_args()
    compiled = torch.compile(_torch_candidates, dynamic=True)
    print(f"device {torch.cuda.get_device_name()}; torch {torch.__version__}; us per draw (graph of {DRAWS})")
    tunings = [(int(b), int(w)) for b in args.bits.split(",") for w in args.warps.split(",")]
    print("| vocab, dtype | batch | torch compiled | "
          + " | ".join(f"triton, {b} bits, {w} warps" for b, w in tunings) + " |")
    print("|---" * (3 + len(tunings)) + "|")
    for vocab, dtype in ((2048, torch.bfloat16), (3072, torch.float32)):
        for b in (int(x) for x in args.batches.split(",")):
            logits = (torch.randn(b, vocab, device="cuda") * 3).to(dtype)
            params = SamplingParams.build(b, "cuda", True, 0.9, 50, 1.0)
            seed, frame = torch.arange(b, device="cuda"), torch.zeros(b, dtype=torch.int64, device="cuda")
            cells = [time_draw(compiled, logits, params, seed, frame)]
            for bits, w in tunings:
                triton_sampling.RADIX_BITS, triton_sampling.NUM_WARPS = bits, w
                cells.append(time_draw(triton_sampling.sample_top_candidates, logits, params, seed, frame))
            print(f"| {vocab}, {str(dtype).removeprefix('torch.')} | {b} | " + " | ".join(f"{c:.1f}" for c in cells) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
