"""topk_sampling.sample_top_candidates as ONE Triton kernel per draw, for CUDA.

A frame draws 16 times. The torch version, compiled, is a top-k selection plus ~3 fused kernels: 26-38 us per
draw on an H100, ~0.5 ms of a 5.6-8.4 ms frame; this kernel takes 10-14 us (benchmarks/sampler_bench.py,
docs/performance.md). Here one program per row reads the row's logits once (bf16 or fp32, no conversion
kernel before it) and does everything in registers: the k-th largest score by a radix select over the scores'
order-preserving bits (KEY_BITS / RADIX_BITS counting passes, no sort), the softmax over the kept scores, the
per-request noise (the same hash as rng.exponential_noise_at, so the draws equal the torch path's), and the
exponential race.
The tokens equal those of the general sampler (serving.model.sampler.sample on the same noise) and so of
sample_top_candidates, with one difference from the latter: where more than CANDIDATES scores tie at the k-th
score, all of them stay, as in transformers' top-k (the torch candidate sampler keeps only its CANDIDATES).
Logits of 2 bytes (the code predictor's bfloat16 heads: 15 of a frame's 16 draws) are ranked by their own 16 bits,
half the passes of a float32 score's 32: dividing by a positive temperature keeps their order, and two distinct
bfloat16 or float16 values stay distinct in float32 (their spacing is 2**-8 or 2**-11 of their size, the
division's rounding 2**-24), so the kept ids are the same, ties included.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from serving.engine.topk_sampling import CANDIDATES
from serving.model.sampler import SamplingParams


@triton.jit
def _mix32(x):
    """rng._mix32 on int64 lanes (uint32 values; every product stays below 2**63)."""
    x = x & 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = ((x & 0xFFFF) * 0x7FEB352D + (((x >> 16) * 0x7FEB352D) & 0xFFFF) * 65536) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = ((x & 0xFFFF) * 0x846CA68B + (((x >> 16) * 0x846CA68B) & 0xFFFF) * 65536) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _sample_kernel(logits_ptr, row_stride, do_sample_ptr, temperature_ptr, top_k_ptr, seed_ptr, frame_ptr, out_ptr,
                   group, vocab, max_k, BLOCK: tl.constexpr, BITS: tl.constexpr, KEY_BITS: tl.constexpr):
    row = tl.program_id(0)
    ids = tl.arange(0, BLOCK)
    valid = ids < vocab
    raw = tl.load(logits_ptr + row * row_stride + ids, mask=valid, other=float("-inf"))
    x = raw.to(tl.float32)
    greedy = tl.argmax(x, 0)
    do_sample = tl.load(do_sample_ptr + row) != 0
    temperature = tl.where(do_sample, tl.load(temperature_ptr + row), 1.0)
    scores = x / temperature
    k = tl.minimum(tl.maximum(tl.load(top_k_ptr + row), 1), max_k)
    # order-preserving unsigned keys of the scores (of 2-byte logits: of the logits, in the same order); padding
    # gets 0, below every real score
    if KEY_BITS == 16:
        bits = raw.to(tl.uint16, bitcast=True).to(tl.uint32)
    else:
        bits = scores.to(tl.uint32, bitcast=True)
    sign = tl.full((), 1 << (KEY_BITS - 1), tl.uint32)
    keys = tl.where((bits & sign) != 0, bits ^ (sign | (sign - 1)), bits | sign)
    keys = tl.where(valid, keys, tl.zeros((), tl.uint32))
    # radix select: the largest key T with at least k keys >= T is the k-th largest score's key, found BITS bits
    # at a time from the top: of the 2**BITS next digits, the largest that keeps k keys at or above (digit 0
    # always does), all counted in one reduction
    kth = tl.zeros((), dtype=tl.uint32)
    digits = tl.arange(0, 1 << BITS).to(tl.uint32)
    for i in range(KEY_BITS // BITS):
        shift = KEY_BITS - BITS * (i + 1)
        counts = tl.sum((keys[None, :] >= (kth | (digits << shift))[:, None]).to(tl.int32), 1)
        kth = kth | ((tl.sum((counts >= k).to(tl.int32), 0) - 1).to(tl.uint32) << shift)
    kept = valid & (keys >= kth)
    top = tl.max(tl.where(kept, scores, float("-inf")), 0)
    weights = tl.where(kept, tl.exp(scores - top), 0.0)
    probs = weights / tl.sum(weights, 0)
    # Exp(1) noise of (seed, frame, group, id): rng.exponential_noise_at
    seed = tl.load(seed_ptr + row)
    frame = tl.load(frame_ptr + row)
    h = _mix32(seed & 0xFFFFFFFF) ^ _mix32((seed >> 32) + 0x9E3779B9)
    h = _mix32(h ^ _mix32(frame * 64 + group))
    draw = _mix32(h ^ _mix32(ids.to(tl.int64) + 0x632BE5AB))
    uniform = ((draw >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    race = tl.where(kept, probs / -tl.log(uniform), -1.0)
    sampled = tl.argmax(race, 0)
    tl.store(out_ptr + row, tl.where(do_sample, sampled, greedy).to(tl.int64))


NUM_WARPS = 8  # per program (one row): the best of 4, 8 and 16 on an H100 (benchmarks/sampler_bench.py)
RADIX_BITS = 2  # bits of the k-th score's key found per counting pass (1, 2 or 4; sampler_bench.py)


def sample_top_candidates(logits: torch.Tensor, params: SamplingParams, seed: torch.Tensor, frame: torch.Tensor,
                          group: int) -> torch.Tensor:
    """topk_sampling.sample_top_candidates (same arguments, same tokens); logits [B, V] in any float dtype."""
    batch, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    block = triton.next_power_of_2(vocab)
    _sample_kernel[(batch,)](logits, logits.stride(0), params.do_sample, params.temperature, params.top_k, seed,
                             frame, out, group, vocab, min(CANDIDATES, vocab), BLOCK=block, BITS=RADIX_BITS,
                             KEY_BITS=16 if logits.element_size() == 2 else 32, num_warps=NUM_WARPS)
    return out
