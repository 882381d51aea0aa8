"""The fused Triton decoder layers compute what the torch stack computes. The code predictor's: the same heads'
logits and the same cached keys and values, pass after pass (a 2-position first pass, then one position at a
time, as a frame runs them), in float32 and bfloat16, for 1 to 8 rows, and the wide layers (torch's products
around the fused attention, over 16 rows a program per group of query heads) for 1 and 20. The talker's (a cache
longer than one block of keys): the same hidden states and caches for rows at positions 0, 63, 64 and 90, each
attending to its own positions under the decode step's mask. And a talker stage that runs its code predictor and
its talker through them, or its code predictor through the wide layers, draws the same codes as the stage
without them.

CI has no GPU, so the kernels run in Triton's interpreter (TRITON_INTERPRET=1, CPU tensors), in a child process
since Triton reads the variable when the kernels are decorated.
"""

import textwrap

import pytest

from tests.triton_interpreter import run_interpreted

pytest.importorskip("triton", reason="triton is a test dependency (scripts/setup.sh --test installs it)")

SCRIPT = textwrap.dedent("""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from serving.engine import triton_layers
    from serving.engine.checkpoint import resolve_model
    from serving.engine.engine import EngineConfig
    from serving.engine.loader import load_stages
    from serving.engine.request import GenerationRequest, SamplingParams
    from serving.engine.talker_stage import fused_stack
    from serving.model.config import TransformerConfig
    from serving.model.layers import DecoderStack, KVCache, attention_mask

    torch.manual_seed(0)
    # head_dim 16 of 4 query and 2 key/value heads; widths that are no multiple of the kernels' tiles
    cfg = TransformerConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                            max_position_embeddings=64, vocab_size=40)
    stack = DecoderStack(cfg, max_positions=16)
    with torch.no_grad():
        for p in stack.parameters():
            p.normal_(0, 0.3)
    head = torch.randn(40, 48) * 0.3
    triton_layers._TILES["attention"]["wide"] = (2, 2)  # the wide layers' attention: both heads of a group at once
    checked = {"fused": 0, "wide": 0}
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 4e-2)):  # bfloat16: an ulp or two of the sums
        model, weight = stack.to(dtype), head.to(dtype)
        runs = [("fused", triton_layers.FusedStack(model), batch) for batch in (1, 8)]
        runs += [("wide", triton_layers.WideStack(model), batch) for batch in (1, 20)]  # over MAX_ROWS
        for kind, fused, batch in runs:
            want_cache = KVCache.for_stack(cfg, batch, 16, dtype, "cpu")
            k, v = torch.full_like(want_cache.k, 9.0), torch.full_like(want_cache.v, 9.0)
            x = torch.randn(batch, 2, 48).to(dtype)
            pos = torch.arange(2).expand(batch, 2)  # strided, as the talker stage passes it
            for _ in range(3):
                with torch.inference_mode():
                    want = model(x, pos, want_cache, pos, kv_len=int(pos[0, -1]) + 1, mask=None)
                    got = fused(x, pos, k, v)
                    if kind == "fused":
                        logits = fused.head(got[:, -1], weight)  # strided rows
                    else:  # the stage's path: the stack's final norm, then the head
                        logits = F.linear(model.norm(got[:, -1]), weight)
                assert logits.dtype == dtype and logits.shape == (batch, 40)
                torch.testing.assert_close(logits.float(), F.linear(want[:, -1], weight).float(), atol=tol, rtol=tol)
                n = int(pos[0, -1]) + 1
                for got_c, want_c in ((k, want_cache.k), (v, want_cache.v)):
                    torch.testing.assert_close(got_c[..., :n, :].float(), want_c[..., :n, :].float(), atol=tol,
                                               rtol=tol)
                    assert (got_c[..., n:, :] == 9).all()  # later positions untouched
                x, pos = torch.randn(batch, 1, 48).to(dtype), torch.full((batch, 1), n)
                checked[kind] += 1
    print("passes", checked["fused"], checked["wide"])

    # the talker's steps: one new position per row over a 100-position cache, read in blocks of MAX_KEYS
    long_stack = DecoderStack(cfg, max_positions=128)
    long_stack.load_state_dict(stack.state_dict(), strict=False)
    steps = 0
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 4e-2)):
        model = long_stack.to(dtype)
        fused = triton_layers.FusedStack(model)
        want_cache = KVCache.for_stack(cfg, 4, 100, dtype, "cpu")
        want_cache.k.normal_(), want_cache.v.normal_()
        k, v = want_cache.k.clone(), want_cache.v.clone()
        pos = torch.tensor([[0], [63], [64], [90]])
        for _ in range(2):
            x = torch.randn(4, 1, 48).to(dtype)
            mask = attention_mask(pos, torch.arange(100)[None, :] <= pos)
            with torch.inference_mode():
                want = model(x, pos, want_cache, pos, kv_len=100, mask=mask)
                got = model.norm(fused(x, pos, k, v))
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
            torch.testing.assert_close(k.float(), want_cache.k.float(), atol=tol, rtol=tol)
            torch.testing.assert_close(v.float(), want_cache.v.float(), atol=tol, rtol=tol)
            pos = pos + 1
            steps += 1
    try:
        fused(torch.randn(1, 2, 48).to(dtype), torch.arange(2)[None], k[:, :1], v[:, :1])
    except ValueError as exc:
        assert "the fused layers take one" in str(exc)
    else:
        raise AssertionError("two new positions over a long cache were taken")
    print("talker steps", steps)

    config = EngineConfig(model=str(resolve_model("tiny-random")), max_batch_size=4, max_model_len=128,
                          chunk_frames=4, first_chunk_frames=2, left_context_frames=4)
    runner, _codec, _info = load_stages(config)
    assert runner.fused_cp is None and runner.fused_cp_rows == 0  # CPU: the torch modules
    assert runner.fused_talker is None and runner.fused_talker_rows == 0 and runner.wide_cp is None

    def decode(count, frames):
        reqs = [GenerationRequest(task="CustomVoice", text=t, speaker=s, max_new_tokens=20,
                                  sampling=SamplingParams(seed=i + 1))
                for i, (t, s) in enumerate(zip(["Hello there.", "A longer one.", "Short."], ["vivian", "ryan", "dylan"]))]
        for result in runner.prefill_many(list(enumerate(reqs[:count]))):
            assert not isinstance(result, Exception)
        out = np.stack([runner.decode_step(count)[0] for _ in range(frames)])
        for slot in range(count):
            runner.release(slot)
        return out

    expected = {1: decode(1, frames=2), 3: decode(3, frames=1)}  # two frames: the cache is reused across them
    runner.fused_cp = fused_stack(runner.talker.code_predictor.model, runner.device, force=True)
    runner.fused_talker = fused_stack(runner.talker.model, runner.device, force=True)
    for role in ("qkv", "gate_up", "o", "down", "head"):  # wider tiles: the interpreter runs a grid's programs
        tiles = triton_layers._TILES[role]  # one by one, and the heads' 2048 outputs were 1024 programs per call
        tiles["gemv"] = (64,) + tiles["gemv"][1:]
    runner.fused_cp_rows = 2  # 1 row fused, 3 rows through the modules
    np.testing.assert_array_equal(decode(1, frames=2), expected[1])
    np.testing.assert_array_equal(decode(3, frames=1), expected[3])
    runner.fused_cp_rows = 8
    np.testing.assert_array_equal(decode(3, frames=1), expected[3])
    runner.fused_talker_rows = 8  # the talker's layers fused as well
    np.testing.assert_array_equal(decode(1, frames=2), expected[1])
    np.testing.assert_array_equal(decode(3, frames=1), expected[3])
    runner.fused_cp_rows, runner.fused_talker_rows = 0, 0  # every step's code predictor through the wide layers
    runner.wide_cp = fused_stack(runner.talker.code_predictor.model, runner.device, force=True, wide=True)
    np.testing.assert_array_equal(decode(1, frames=2), expected[1])
    np.testing.assert_array_equal(decode(3, frames=1), expected[3])
    print("codes equal")
""")


@pytest.mark.slow
def test_fused_layers_compute_the_torch_stack():
    out = run_interpreted(SCRIPT)
    assert "passes 12 12" in out and "talker steps 4" in out and "codes equal" in out


def test_programmatic_dependent_launch_only_for_few_rows_on_hopper(monkeypatch):
    """PDL goes to calls of up to PDL_ROWS rows on CUDA devices of compute capability 9 or later, never on the
    CPU or in the interpreter, and not when switched off; a kernel gets PDL=True exactly when it is launched so."""
    import torch

    from serving.engine import triton_layers

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(triton_layers, "_INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    triton_layers._has_pdl.cache_clear()
    assert triton_layers._pdl(cuda, 1) == {"PDL": True, "launch_pdl": True}
    assert triton_layers._pdl(cuda, triton_layers.PDL_ROWS) == {"PDL": True, "launch_pdl": True}
    assert triton_layers._pdl(cuda, triton_layers.PDL_ROWS + 1) == {"PDL": False}
    assert triton_layers._launch(1, 64, 64, "qkv", cuda)["launch_pdl"] is True
    assert "launch_pdl" not in triton_layers._launch(8, 64, 64, "qkv", cuda)
    assert triton_layers._pdl(torch.device("cpu"), 1) == {"PDL": False}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    triton_layers._has_pdl.cache_clear()  # asked once per device
    assert triton_layers._pdl(cuda, 1) == {"PDL": False}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    triton_layers._has_pdl.cache_clear()
    monkeypatch.setattr(triton_layers, "PDL", False)
    assert triton_layers._pdl(cuda, 1) == {"PDL": False}
    monkeypatch.setattr(triton_layers, "PDL", True)
    monkeypatch.setattr(triton_layers, "_INTERPRET", True)
    assert triton_layers._pdl(cuda, 1) == {"PDL": False}
    triton_layers._has_pdl.cache_clear()  # no faked capability left behind
