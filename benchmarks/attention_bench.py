"""The talker's decode attention on a GPU: row-length Triton kernel (serving/engine/triton_attention.py) against
SDPA with a mask over the whole KV bucket, for 0.6B's heads (16 query, 8 key/value, head_dim 128) in bfloat16,
with rows of random lengths: the largest difference from float32 SDPA, and microseconds per call of each (200
back-to-back calls after one warm-up, synchronised at the ends).

    python benchmarks/attention_bench.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from serving.engine import triton_attention

CASES = ((16, 256, 1, 256), (128, 1024, 30, 1000), (128, 512, 200, 512))  # rows, bucket, shortest, longest row


def us_per_call(fn, calls: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    torch.manual_seed(0)
    heads, kv_heads, dim, dev = 16, 8, 128, "cuda"
    scale = dim ** -0.5
    triton_attention.MIN_ROWS = 1  # time the kernel at every size, including those serving leaves to SDPA
    for rows, slots, lo, hi in CASES:
        lengths = torch.randint(lo, hi + 1, (rows,), device=dev)
        q = torch.randn(rows, 1, heads, dim, device=dev, dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(rows, kv_heads, slots, dim, device=dev, dtype=torch.bfloat16)
        v = torch.randn(rows, kv_heads, slots, dim, device=dev, dtype=torch.bfloat16)
        mask = (torch.arange(slots, device=dev)[None, :] < lengths[:, None])[:, None, None, :]
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale,
                                              enable_gqa=True)
        err = (triton_attention.decode_attention(q, k, v, lengths, scale).float() - want).abs().max().item()
        sdpa = us_per_call(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                                  enable_gqa=True))
        kernel = us_per_call(lambda: triton_attention.decode_attention(q, k, v, lengths, scale))
        print(f"rows {rows} slots {slots} len {lo}-{hi} (mean {lengths.float().mean():.0f}): max err {err:.4f}  "
              f"sdpa {sdpa:.1f} us  triton {kernel:.1f} us", flush=True)


if __name__ == "__main__":
    main()
