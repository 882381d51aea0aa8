"""The talker's wide layers (triton_layers.WideStack over its long cache: torch's products around row_attention, which
normalises, rotates and caches each row's new key and attends over that row's own positions) compute what the
modules compute under the decode step's mask: the same hidden states and caches, in float32 and bfloat16, for rows
at positions 0, 1, 63, 64, 65, 150 and others (lengths no multiple of the kernel's block), with cache positions past
each row's full of garbage, over two steps; they take one new position per row only. With new prompts' positions as
rows of their own (triton_layers.Prompts: a prompt of 66 positions, past one key block, one of 7 into an empty slot
among the step's rows, and padding rows past the longer one) they give each prompt's hidden states and keys as the
modules' prefill of it, and the step's rows as before. A talker stage whose steps go through them draws the same
codes as the stage without them, one graph per batch bucket serves them, and a request staged while a step is in
flight (TalkerRunner.stage: its prompt rows ride that step) has the codes of a prefill before that step: the step
draws its first frame from its prompt's last hidden state.

CI has no GPU, so the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, CPU tensors), in a child process.
The interpreter rounds float32 to bfloat16 by truncation (Triton 3.9), where a GPU and torch round to nearest: there
most of the kernel's bfloat16 keys sit an ulp from the modules', hence the bfloat16 tolerance.
"""

import textwrap

import pytest

from tests.triton_interpreter import run_interpreted

pytest.importorskip("triton", reason="triton is a test dependency (scripts/setup.sh --test installs it)")

SCRIPT = textwrap.dedent("""
    import numpy as np
    import torch
    from serving.engine import triton_layers
    from serving.engine.checkpoint import resolve_model
    from serving.engine.engine import EngineConfig
    from serving.engine.loader import load_stages
    from serving.engine.request import GenerationRequest, SamplingParams
    from serving.engine.talker_stage import fused_stack
    from serving.model.config import TransformerConfig
    from serving.model.layers import DecoderStack, KVCache, attention_mask

    torch.manual_seed(0)
    # 6 query heads over 2 key/value heads (a group of 3: padded to the 16-row tile), head_dim 16
    cfg = TransformerConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
                            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                            max_position_embeddings=256, vocab_size=40)
    stack = DecoderStack(cfg, max_positions=256)
    with torch.no_grad():
        for p in stack.parameters():
            p.normal_(0, 0.3)
    assert triton_layers.WideStack.supports(stack)
    slots = 160
    pos = torch.tensor([0, 1, 63, 64, 65, 150, 7, 129, 3, 100, 1, 90, 33, 127, 5, 77, 158])[:, None]
    rows = pos.shape[0]
    steps = 0
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 4e-2)):
        model = stack.to(dtype)
        wide = triton_layers.WideStack(model)
        want_cache = KVCache.for_stack(cfg, rows, slots, dtype, "cpu")
        want_cache.k.normal_(), want_cache.v.normal_()
        k, v = want_cache.k.clone(), want_cache.v.clone()
        past = torch.arange(slots)[None, None, None, :, None] > pos[None, :, None, :, None] + 1
        k[past.expand_as(k)], v[past.expand_as(v)] = 1e4, -1e4  # past each row's positions: never read
        step_pos = pos
        for _ in range(2):
            x = torch.randn(rows, 1, 48).to(dtype)
            mask = attention_mask(step_pos, torch.arange(slots)[None, :] <= step_pos)
            with torch.inference_mode():
                want = model(x, step_pos, want_cache, step_pos, kv_len=slots, mask=mask)
                got = model.norm(wide(x, step_pos, k, v))
            assert got.dtype == dtype and got.shape == (rows, 1, 48)
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
            for got_c, want_c in ((k, want_cache.k), (v, want_cache.v)):
                seen = torch.arange(slots)[None, :] <= step_pos  # [rows, slots]: what the step wrote and read
                torch.testing.assert_close(got_c.transpose(2, 3)[:, seen].float(),
                                           want_c.transpose(2, 3)[:, seen].float(), atol=tol, rtol=tol)
            step_pos = step_pos + 1
            steps += 1
    try:
        wide(torch.randn(2, 2, 48).to(dtype), torch.arange(2).expand(2, 2), k[:, :2], v[:, :2])
    except ValueError as exc:
        assert "the wide layers take one" in str(exc)
    else:
        raise AssertionError("two new positions per row over a long cache were taken")
    print("wide talker steps", steps)

    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 4e-2)):
        model = stack.to(dtype)
        wide = triton_layers.WideStack(model)
        pos = torch.tensor([5, 70, 0, 33, 0, 129])[:, None]  # slots 2 and 4 are empty: they take the prompts
        lengths = {2: 7, 4: 66}
        want = KVCache.for_stack(cfg, 6, slots, dtype, "cpu")
        want.k.normal_(), want.v.normal_()
        k, v = want.k.clone(), want.v.clone()
        x = torch.randn(6, 1, 48).to(dtype)
        prompts = {s: torch.randn(n, 48).to(dtype) for s, n in lengths.items()}
        px = torch.cat([prompts[2], prompts[4], torch.randn(3, 48).to(dtype)])  # 3 padding rows past slot 4's
        prompt_slots = torch.tensor([2] * 7 + [4] * 69)
        prompt_pos = torch.cat([torch.arange(7), torch.arange(69)])[:, None]
        with torch.inference_mode():
            mask = attention_mask(pos, torch.arange(slots)[None, :] <= pos)
            want_x = model(x, pos, want, pos, kv_len=slots, mask=mask)
            want_p = {s: model(p[None], torch.arange(len(p))[None], want, torch.arange(len(p))[None], kv_len=len(p),
                               mask=None, rows=torch.tensor([[s]]))[0] for s, p in prompts.items()}
            got_x, got_p = wide(x, pos, k, v, triton_layers.Prompts(px, prompt_slots, prompt_pos, k, v))
            got_x, got_p = model.norm(got_x), model.norm(got_p)[:, 0]
        for s in (0, 1, 3, 5):
            n = int(pos[s]) + 1
            torch.testing.assert_close(got_x[s].float(), want_x[s].float(), atol=tol, rtol=tol)
            torch.testing.assert_close(k[:, s, :, :n].float(), want.k[:, s, :, :n].float(), atol=tol, rtol=tol)
        torch.testing.assert_close(got_p[:7].float(), want_p[2].float(), atol=tol, rtol=tol)
        torch.testing.assert_close(got_p[7:73].float(), want_p[4].float(), atol=tol, rtol=tol)
        for s, n in lengths.items():
            for got_c, want_c in ((k, want.k), (v, want.v)):
                torch.testing.assert_close(got_c[:, s, :, :n].float(), want_c[:, s, :, :n].float(), atol=tol, rtol=tol)
    print("prompt rows equal")

    config = EngineConfig(model=str(resolve_model("tiny-random")), max_batch_size=4, max_model_len=128,
                          chunk_frames=4, first_chunk_frames=2, left_context_frames=4)
    runner, _codec, _info = load_stages(config)
    assert runner.wide_talker is None and runner.wide_talker_rows is None  # CPU: the modules
    assert not runner.reads_own_keys(4) and runner.graph_kv_buckets(4) == runner.kv_buckets

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

    expected = decode(frames=4)
    runner.wide_talker = fused_stack(runner.talker.model, runner.device, force=True, wide=True)
    runner.wide_talker_rows = 3  # the interpreter is slow: fewer rows than a GPU step takes
    assert runner.reads_own_keys(4) and not runner.reads_own_keys(2)
    assert runner.graph_kv_buckets(4) == (0,) and runner.graph_kv(4, 100) == 0
    assert runner.graph_kv(2, 100) == min(b for b in runner.kv_buckets if b >= 100)
    np.testing.assert_array_equal(decode(frames=4), expected)
    print("codes equal")

    from tests.test_engine_batching import staged_schedule
    runner.wide_talker, runner.wide_talker_rows = None, None
    runner.set_up_prompt_rows()
    want = staged_schedule(runner, stage=False, prefill_at=2)  # carried: the request's first frame is the ride's
    runner.wide_talker = fused_stack(runner.talker.model, runner.device, force=True, wide=True)
    runner.wide_talker_rows = 3
    runner.set_up_prompt_rows()
    assert runner.takes_prompts(4) and runner.step_prompt_rows == (32, 64, 128)
    got = staged_schedule(runner, stage=True)
    assert got[2].shape == (5, 16)
    for slot in want:
        np.testing.assert_array_equal(got[slot], want[slot])
    print("staged codes equal")
""")


@pytest.mark.slow
def test_wide_talker_layers_compute_the_masked_modules():
    out = run_interpreted(SCRIPT)
    assert "wide talker steps 4" in out and "prompt rows equal" in out and "codes equal" in out
    assert "staged codes equal" in out
