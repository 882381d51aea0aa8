"""The talker's row-length decode attention computes what masked SDPA computes over each row's own positions (float32
and bfloat16, rows of 1 to 150 keys, cache positions past a row's length full of garbage, lengths not a multiple of
the kernel's block), declines steps of fewer rows than it takes, and a talker stage that attends through it draws
the same codes as the stage without it.

CI has no GPU, so the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, CPU tensors), in a child process.
"""

import textwrap

import pytest

from tests.triton_interpreter import run_interpreted

pytest.importorskip("triton", reason="triton is a test dependency (scripts/setup.sh --test installs it)")

SCRIPT = textwrap.dedent("""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from serving.engine import triton_attention
    from serving.engine.checkpoint import resolve_model
    from serving.engine.engine import EngineConfig
    from serving.engine.loader import load_stages
    from serving.engine.request import GenerationRequest, SamplingParams
    from serving.engine.talker_stage import row_length_attention

    torch.manual_seed(0)
    rows, heads, kv_heads, dim, slots = 17, 4, 2, 16, 160
    lengths = torch.tensor([1, 2, 63, 64, 65, 150, 7, 129, 3, 100, 1, 90, 33, 128, 5, 77, 150])
    q = torch.randn(3, 1, heads, dim).transpose(1, 2)
    k = v = torch.randn(3, kv_heads, slots, dim)
    assert triton_attention.decode_attention(q, k, v, lengths[:3], 0.3) is None  # too few rows: SDPA's
    triton_attention.MIN_ROWS = 1  # the interpreter is slow: fewer rows than a GPU step takes
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        q = torch.randn(rows, 1, heads, dim).to(dtype).transpose(1, 2)  # strided, as the layer passes it
        k = torch.randn(rows, kv_heads, slots, dim).to(dtype)
        v = torch.randn(rows, kv_heads, slots, dim).to(dtype)
        for cache in (k, v):
            cache[torch.arange(slots)[None, None, :, None].expand_as(cache) >= lengths[:, None, None, None]] = 1e4
        mask = (torch.arange(slots)[None, :] < lengths[:, None])[:, None, None, :]
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=0.3,
                                              enable_gqa=True)
        got = triton_attention.decode_attention(q, k, v, lengths, 0.3)
        assert got.dtype == dtype and got.shape == (rows, heads, 1, dim)
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    print("kernel equal")

    config = EngineConfig(model=str(resolve_model("tiny-random")), max_batch_size=4, max_model_len=128,
                          chunk_frames=4, first_chunk_frames=2, left_context_frames=4)
    runner, _codec, _info = load_stages(config)
    assert not runner.row_length_attention  # CPU: SDPA

    def decode(frames):
        reqs = [GenerationRequest(task="CustomVoice", text=t, speaker=s, max_new_tokens=20,
                                  sampling=SamplingParams(seed=i + 1))
                for i, (t, s) in enumerate(zip(["Hello there.", "A much longer one, with more words.", "Short."],
                                               ["vivian", "ryan", "dylan"]))]
        for result in runner.prefill_many(list(enumerate(reqs))):
            assert not isinstance(result, Exception)
        out = np.stack([runner.decode_step(4)[0][:3] for _ in range(frames)])  # bucket 4: a padding row, unread
        for slot in range(3):
            runner.release(slot)
        return out

    expected = decode(frames=6)
    assert row_length_attention(runner.talker.model, runner.device, force=True)
    np.testing.assert_array_equal(decode(frames=6), expected)
    print("codes equal")
""")


@pytest.mark.slow
def test_row_length_attention_computes_masked_sdpa():
    out = run_interpreted(SCRIPT)
    assert "kernel equal" in out and "codes equal" in out
