"""Prefill graphs (cuda_graphs.PrefillGraphs) on a CPU: the captured function runs eagerly there, so this checks the
logic a GPU replays: prompts right-padded to their (prompts, length) bucket, the batch padded with copies of the
first, give the hidden states and keys/values of each one's unpadded prefill and land in their own slots only;
an admission's groups take the cheapest bucket that holds them, and prompts no bucket holds are left to the
batched pass."""

import torch

from serving.engine.checkpoint import resolve_model
from serving.engine.cuda_graphs import PrefillGraphs, prefill_shapes
from serving.engine.engine import EngineConfig
from serving.engine.loader import load_stages
from serving.engine.request import GenerationRequest

CONFIG = dict(max_batch_size=4, max_model_len=128, chunk_frames=4, first_chunk_frames=2, left_context_frames=4)
TEXTS = ("Hello there.", "A much longer sentence for the prefill to chew on, really.")


def test_bucketed_prefill_equals_the_direct_one_in_its_own_slot():
    runner, _codec, _info = load_stages(EngineConfig(model=str(resolve_model("tiny-random")), **CONFIG))
    assert runner.prefill_graphs is None  # CPU: no graphs in the server; the class itself runs eagerly
    graphs = PrefillGraphs(runner.talker.model, runner.kv, ((1, 16), (1, 32), (1, 64)), runner.device, runner.dtype)
    for text in TEXTS:
        request = GenerationRequest(task="CustomVoice", text=text, speaker="vivian", max_new_tokens=20)
        prompt, _codes = runner.prompts.build_many([request], runner._voice_cache_lookup)[0]
        n = prompt.prefill.shape[0]
        assert 16 < n <= 64
        runner.kv.k.zero_(), runner.kv.v.zero_()
        runner.prefill(1, request)  # the direct (unpadded) pass into slot 1
        want_hidden = runner.hidden[1].clone()
        want_k, want_v = runner.kv.k[:, 1, :, :n].clone(), runner.kv.v[:, 1, :, :n].clone()
        runner.kv.k.zero_(), runner.kv.v.zero_()
        with torch.inference_mode():
            hidden = graphs.run([prompt.prefill], [2])
        torch.testing.assert_close(hidden[0], want_hidden, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(runner.kv.k[:, 2, :, :n], want_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(runner.kv.v[:, 2, :, :n], want_v, atol=1e-5, rtol=1e-5)
        others = [s for s in range(runner.num_slots) if s != 2]
        _rows, bucket = graphs.bucket(1, n)  # the padding's keys go up to the bucket, no further
        assert not runner.kv.k[:, others].any() and not runner.kv.k[:, 2, :, bucket:].any()
    long_prompt = torch.zeros(65, runner.talker.cfg.transformer.hidden_size)
    assert graphs.run([long_prompt], [0]) is None  # beyond the largest bucket: the batched path's job


def test_an_admission_through_prefill_graphs_sets_up_every_slot_as_the_direct_prefill_does():
    """prefill_many with graphs (run eagerly here): prompts that fit a bucket replay one by one and their slots
    are set up together afterwards; a longer one takes the batched pass. Each slot ends as a direct prefill
    of its request alone leaves it."""
    runner, _codec, _info = load_stages(EngineConfig(model=str(resolve_model("tiny-random")), **CONFIG))
    requests = [GenerationRequest(task="CustomVoice", text=text, speaker=speaker, max_new_tokens=20)
                for text, speaker in ((TEXTS[0], "vivian"), (TEXTS[1], "ryan"), (TEXTS[1] * 2, "vivian"))]
    want = []
    for request in requests:
        runner.prefill(0, request)
        n = runner.lengths[0]
        want.append((n, runner.hidden[0].clone(), runner.kv.k[:, 0, :, :n].clone(), runner.trailing_len[0].item()))
        runner.release(0)
    runner.prefill_graphs = PrefillGraphs(runner.talker.model, runner.kv, ((1, 32), (1, 64)), runner.device,
                                          runner.dtype)
    assert want[2][0] > 64  # the third prompt is longer than every bucket
    results = runner.prefill_many([(3, requests[0]), (1, requests[1]), (2, requests[2])])
    assert not any(isinstance(r, Exception) for r in results)
    for slot, (n, hidden, k, trailing) in zip((3, 1, 2), want):
        assert runner.lengths[slot] == runner.pos[slot].item() == n
        assert runner.active[slot].item() == 1 and runner.trailing_len[slot].item() == trailing
        torch.testing.assert_close(runner.hidden[slot], hidden, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(runner.kv.k[:, slot, :, :n], k, atol=1e-5, rtol=1e-5)


def test_prefill_buckets_keep_within_the_pass_budget_and_the_slots():
    lengths = (32, 64, 128, 256, 512, 1024)
    shapes = prefill_shapes(lengths, 128, 8192)
    assert [n for r, n in shapes if r == 1] == list(lengths)  # one prompt: every length
    assert {r for r, _ in shapes} == {1, 4, 16, 32, 64, 128}
    assert max(r * n for r, n in shapes if r > 1) == 8192 and (32, 256) in shapes and (64, 256) not in shapes
    assert {r for r, _ in prefill_shapes(lengths, 100, 8192)} == {1, 4, 16, 32, 64, 100}  # no more rows than slots
    assert {r for r, _ in prefill_shapes(lengths, 8, 8192)} == {1, 4, 8}


def test_a_burst_replays_the_batched_buckets_and_each_slot_ends_as_its_own_prefill_leaves_it():
    """Four prompts into scattered slots: the three short ones share a 4-prompt bucket (its fourth row a copy of
    the first prompt bound for its slot); the long one, which no bucket of several prompts holds, goes alone.
    The other slots stay untouched, and each slot's hidden state, keys, values and setup equal a direct prefill
    of its request alone."""
    config = dict(CONFIG, max_batch_size=8)
    runner, _codec, _info = load_stages(EngineConfig(model=str(resolve_model("tiny-random")), **config))
    texts = [TEXTS[0], "Short one here.", "Another short line.", TEXTS[1] * 2]
    requests = [GenerationRequest(task="CustomVoice", text=t, speaker=s, max_new_tokens=20)
                for t, s in zip(texts, ("vivian", "ryan", "dylan", "ryan"))]
    want = []
    for request in requests:
        runner.prefill(0, request)
        n = runner.lengths[0]
        want.append((n, runner.hidden[0].clone(), runner.kv.k[:, 0, :, :n].clone(), runner.kv.v[:, 0, :, :n].clone()))
        runner.release(0)
    assert max(w[0] for w in want[:3]) <= 48 < want[3][0] <= 128
    graphs = PrefillGraphs(runner.talker.model, runner.kv, ((1, 48), (1, 128), (4, 48), (8, 16)), runner.device,
                           runner.dtype)
    replayed = []
    real_pass = graphs._pass
    graphs._pass = lambda rows, length: replayed.append((rows, length)) or real_pass(rows, length)
    runner.prefill_graphs = graphs
    runner.kv.k.zero_(), runner.kv.v.zero_()
    slots = [6, 1, 4, 2]
    results = runner.prefill_many(list(zip(slots, requests)))
    assert not any(isinstance(r, Exception) for r in results)
    assert sorted(replayed) == [(1, 128), (4, 48)]  # the short ones together (the cheapest bucket), the long alone
    for slot, (n, hidden, k, v) in zip(slots, want):
        assert runner.lengths[slot] == runner.pos[slot].item() == n and runner.active[slot].item() == 1
        torch.testing.assert_close(runner.hidden[slot], hidden, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(runner.kv.k[:, slot, :, :n], k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(runner.kv.v[:, slot, :, :n], v, atol=1e-5, rtol=1e-5)
    untouched = [s for s in range(runner.num_slots) if s not in slots]
    assert not runner.kv.k[:, untouched].any() and not runner.kv.v[:, untouched].any()


def test_a_large_burst_is_cut_into_groups_the_buckets_hold():
    """127 prompts of 18 to 1100 positions (a long set's burst and a few longer than every bucket): sorted by length,
    each group is the most prompts a bucket holds, or, past every bucket, a batched pass within the token budget."""
    from types import SimpleNamespace

    from serving.engine.cuda_graphs import make_kv_buckets
    from serving.engine.talker_stage import PREFILL_TOKEN_BUDGET

    runner, _codec, _info = load_stages(EngineConfig(model=str(resolve_model("tiny-random")),
                                                     **dict(CONFIG, max_batch_size=128, max_model_len=2048)))
    lengths = make_kv_buckets(1024, 32)
    runner.prefill_graphs = PrefillGraphs(runner.talker.model, runner.kv, prefill_shapes(lengths, 128, 8192),
                                          runner.device, runner.dtype)
    sizes = [18 + (i * 37) % 211 for i in range(120)] + [300, 600, 1000, 1030, 1100, 1500, 2000]
    built = [(slot, None, SimpleNamespace(prefill=torch.zeros(n, 1))) for slot, n in enumerate(sizes)]
    groups = []
    runner._prefill_group = lambda group: groups.append([e[2].prefill.shape[0] for e in group]) or []
    runner._prefill_groups(built)
    assert [n for g in groups for n in g] == sorted(sizes)
    graphs = runner.prefill_graphs
    for i, group in enumerate(groups):
        if graphs.bucket(len(group), group[-1]) is not None:
            if i + 1 < len(groups):  # it took every prompt its bucket's kind could: one more breaks every bucket
                assert graphs.bucket(len(group) + 1, groups[i + 1][0]) is None
        else:
            assert sum(group) <= PREFILL_TOKEN_BUDGET or len(group) == 1
    held = [g for g in groups if graphs.bucket(len(g), g[-1]) is not None]
    assert sum(map(len, held)) == 123 and [g for g in groups if g not in held] == [[1030, 1100, 1500, 2000]]
