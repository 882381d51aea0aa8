"""The talker's decode attention at many rows on a GPU: the wide layers' one kernel (triton_layers.row_attention: q/k
norm, rotary, cache writes, attention over each row's own positions) against what the compiled modules run for the
same work (q/k norms, rotary, the two cache writes, SDPA under the step's mask over the whole KV bucket), 0.6B heads
(16 query, 8 key/value, head_dim 128) in bfloat16, rows of lengths spread evenly between the case's shortest and
longest. Prints, per case, microseconds per call of each (8 calls in a CUDA graph, each on its own layer's cache,
as a frame's 28 layers run; graph_timing) and the largest difference of each from the modules in float32.

    python benchmarks/attention_bench.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from fused_layers_bench import stack_config
from graph_timing import us_per_call

from serving.engine import triton_layers
from serving.model.layers import Attention, RotaryTable, apply_rope, attention_mask

CASES = ((32, 256, 30, 250), (32, 1024, 200, 1000), (64, 512, 30, 500), (128, 256, 30, 250),
         (128, 1024, 30, 1000), (128, 768, 200, 700))  # rows, KV bucket, shortest and longest row
CALLS = 8
HEADS, KV_HEADS, DIM = 16, 8, 128


def modules(attn, rotary, qkv, pos, k, v, kv_len, mask):
    """Attention.forward between its projections, for one new position per row."""
    batch = qkv.shape[0]
    q, kk, vv = qkv.view(batch, 1, -1).split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
    q = attn.q_norm(q.view(batch, 1, HEADS, DIM)).transpose(1, 2)
    kk = attn.k_norm(kk.view(batch, 1, KV_HEADS, DIM)).transpose(1, 2)
    cos, sin = rotary(pos, qkv.dtype)
    q, kk = apply_rope(q, cos, sin), apply_rope(kk, cos, sin)
    rows = torch.arange(batch, device=qkv.device)[:, None]
    k[rows, :, pos] = kk.transpose(1, 2)
    v[rows, :, pos] = vv.view(batch, 1, KV_HEADS, DIM)
    out = F.scaled_dot_product_attention(q, k[:, :, :kv_len], v[:, :, :kv_len], attn_mask=mask, scale=attn.scale,
                                         enable_gqa=True)
    return out.transpose(1, 2).reshape(batch, HEADS * DIM)


def main() -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    attn = Attention(stack_config(1, 1024)).to(dev, torch.bfloat16)
    with torch.no_grad():
        attn.q_norm.weight.normal_(1, 0.1), attn.k_norm.weight.normal_(1, 0.1)
    rotary = RotaryTable(DIM, 1e6, 1024).to(dev)
    compiled = torch.compile(modules, dynamic=True)
    print(f"device {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    print("| rows | KV bucket | row lengths | modules us | row_attention us | ratio | max diff from float32: modules "
          "/ row_attention |\n|---|---|---|---|---|---|---|")
    for rows, bucket, low, high in CASES:
        pos = torch.linspace(low - 1, high - 1, rows, device=dev).long()[:, None]  # the new position of each row
        mask = attention_mask(pos, torch.arange(bucket, device=dev)[None, :] <= pos)
        qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * DIM, dtype=torch.bfloat16, device=dev)
        caches = [(torch.randn(rows, KV_HEADS, bucket, DIM, dtype=torch.bfloat16, device=dev),
                   torch.randn(rows, KV_HEADS, bucket, DIM, dtype=torch.bfloat16, device=dev)) for _ in range(CALLS)]
        with torch.inference_mode():
            k32, v32 = caches[0][0].float(), caches[0][1].float()
            want = modules(attn.float(), rotary, qkv.float(), pos, k32, v32, bucket, mask)
            attn.to(torch.bfloat16)
            base = compiled(attn, rotary, qkv, pos, *[c.clone() for c in caches[0]], bucket, mask)
            got = triton_layers.row_attention(qkv, attn, rotary.cos, rotary.sin, pos, *[c.clone() for c in caches[0]])
            errors = [(out.float() - want).abs().max().item() for out in (base, got)]
            us_modules = us_per_call(lambda i: compiled(attn, rotary, qkv, pos, *caches[i], bucket, mask), CALLS)
            us_kernel = us_per_call(lambda i: triton_layers.row_attention(qkv, attn, rotary.cos, rotary.sin, pos,
                                                                          *caches[i]), CALLS)
        print(f"| {rows} | {bucket} | {low}-{high} | {us_modules:.1f} | {us_kernel:.1f} | {us_modules / us_kernel:.2f} "
              f"| {errors[0]:.4f} / {errors[1]:.4f} |", flush=True)


if __name__ == "__main__":
    main()
