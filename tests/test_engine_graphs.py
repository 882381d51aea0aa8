"""The talker stage's graph path on CPU: bucket choice, padding to a larger graph, KV-length buckets, the
fallback to eager steps, the candidate sampler, batched prefill and the --ignore-eos length policy.

CUDA graphs cannot be captured here, so a stand-in replays by running the very step function a graph
would capture, eagerly: the codes it gives must equal the plain eager step's exactly.
"""

import contextlib

import numpy as np
import pytest
import torch

from serving.engine.checkpoint import resolve_model
from serving.engine.cuda_graphs import (FrameGraphs, greatest_priority, make_graph_buckets, make_kv_buckets,
                                       smallest_cover)
from serving.engine.engine import EngineConfig
from serving.engine.length_policy import frame_limit, speech_seconds, text_frames
from serving.engine.loader import load_stages
from serving.engine.request import GenerationRequest, SamplingParams
from serving.engine.rng import exponential_noise, exponential_noise_at
from serving.engine.topk_sampling import CANDIDATES, eligible, sample_top_candidates
from serving.model.sampler import SamplingParams as RowParams
from serving.model.sampler import sample

CONFIG = dict(max_batch_size=8, max_model_len=256, chunk_frames=4, first_chunk_frames=2, left_context_frames=4)


class EagerGraphs(FrameGraphs):
    """Replays a 'graph' by running the captured step function eagerly; records which ones ran."""

    def capture(self, batch, kv_len):
        self.graphs[(batch, kv_len)] = None

    def replay(self, batch, kv_len):
        self.replayed.append((batch, kv_len))
        return self.step(batch, kv_len)


@pytest.fixture(scope="module")
def runner():
    runner, _codec, _info = load_stages(EngineConfig(model=str(resolve_model("tiny-random")), **CONFIG))
    runner.warmup()
    return runner


def use_graphs(runner, graph_buckets):
    graphs = EagerGraphs(lambda b, kv: runner._step(b, kv, True), runner.device)
    graphs.replayed = []
    for b in graph_buckets:
        for kv in runner.graph_kv_buckets(b):
            graphs.capture(b, kv)
    runner.graphs, runner.graph_buckets = graphs, tuple(graph_buckets)
    return graphs


def requests(**sampling):
    texts = ["Hello there.", "A longer sentence, with more words in it.", "Short one."]
    return [GenerationRequest(task="CustomVoice", text=t, speaker=s, max_new_tokens=20,
                              sampling=SamplingParams(seed=i + 1, **sampling))
            for i, (t, s) in enumerate(zip(texts, ["vivian", "ryan", "dylan"]))]


def run(runner, slots, reqs, frames=5, bucket=None, batched=True):
    if batched:
        results = runner.prefill_many(list(zip(slots, reqs)))
    else:
        results = [runner.prefill(slot, req) for slot, req in zip(slots, reqs)]
    bucket = bucket or max(slots) + 1
    out = []
    for _ in range(frames):
        codes, _ended = runner.decode_step(bucket)
        out.append(codes[slots])
    for slot in slots:
        runner.release(slot)
    return np.stack(out, axis=1), results


def test_bucket_ladders_cover_every_size_with_little_padding():
    assert make_kv_buckets(1024) == (128, 192, 256, 384, 512, 768, 1024)
    assert make_kv_buckets(1000) == (128, 192, 256, 384, 512, 768, 1000)
    assert make_kv_buckets(700) == (128, 192, 256, 384, 512, 700)
    assert make_kv_buckets(1024, 32) == (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
    assert make_kv_buckets(100) == (100,)
    assert make_graph_buckets(128, 128) == (1, 2, 4, 8, 16, 32, 48, 64, 96, 128)
    assert make_graph_buckets(100, 128) == (1, 2, 4, 8, 16, 32, 48, 64, 96, 100)
    assert make_graph_buckets(200, 64)[-1] == 64  # bigger batches run eagerly
    assert smallest_cover(33, (1, 2, 4, 8, 16, 32, 48)) == 48
    assert smallest_cover(129, (128, 256)) == 256
    assert smallest_cover(300, (128, 256)) is None
    with pytest.raises(ValueError):
        make_kv_buckets(0)


def test_a_graph_is_warmed_and_captured_on_a_stream_of_its_priority(monkeypatch):
    """PyTorch instantiates graphs with cudaGraphInstantiateFlagUseNodePriority: a replayed kernel keeps its capture
    stream's priority, whatever stream replays it. So FrameGraphs captures on its own stream of `priority` (the
    talker's: the most urgent), never on torch.cuda.graph's default capture stream (priority 0). CUDA's calls are
    stood in for: the test checks which stream each part ran on."""
    class Stream:
        made = []

        def __init__(self, device=None, priority=0):
            self.priority = priority
            Stream.made.append(self)

        def wait_stream(self, other):
            pass

    current = [Stream()]
    ran_on, captured_on = [], []

    @contextlib.contextmanager
    def on(stream):
        current.append(stream)
        yield
        current.pop()

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None, stream=None):
        captured_on.append(stream)
        with on(stream if stream is not None else Stream()):
            yield

    class Graph:
        def pool(self):
            return "pool"

    for name, value in (("Stream", Stream), ("stream", on), ("graph", graph), ("CUDAGraph", Graph),
                        ("current_stream", lambda device=None: current[-1]), ("memory_reserved", lambda d=None: 0),
                        ("synchronize", lambda d=None: None)):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(Stream, "priority_range", staticmethod(lambda: (0, -3)), raising=False)
    assert greatest_priority() == -3
    graphs = FrameGraphs(lambda b, kv: ran_on.append(current[-1]) or (torch.zeros(b),), torch.device("cpu"), -3)
    graphs.capture(2, 8)
    graphs.capture(4, 8)
    side = [s for s in Stream.made if s.priority == -3]
    assert len(side) == 1 and ran_on == side * 4 and captured_on == side * 2
    assert graphs.covers(4, 8) and graphs.pool == "pool"


def test_graph_path_pads_to_a_larger_batch_and_kv_bucket_with_identical_codes(runner):
    reqs = requests()
    runner.graphs, runner.graph_buckets = None, ()
    eager, _ = run(runner, [0, 1, 2], reqs)
    graphs = use_graphs(runner, (1, 2, 4, 8))
    try:
        padded, _ = run(runner, [0, 1, 2], reqs)
    finally:
        runner.graphs, runner.graph_buckets = None, ()
    assert graphs.replayed and all(b == 4 for b, _ in graphs.replayed)  # 3 rows -> the 4-row graph
    assert all(kv == 128 for _, kv in graphs.replayed)  # short prompts: the smallest KV bucket, masked
    assert np.array_equal(padded, eager)


def test_steps_that_read_their_own_keys_take_one_graph_for_every_kv_length(runner, monkeypatch):
    """The fused and wide talker layers attend over each row's own positions, whatever the KV bucket: their batch
    buckets get one graph (KV length 0); the others one per KV bucket, chosen by the longest row."""
    assert runner.kv_buckets == (128, 192, 256) and runner.wide_talker_rows is None  # CPU: the modules at any batch
    assert runner.graph_kv(8, 130) == 192 and runner.graph_kv(8, 257) is None
    monkeypatch.setattr(runner, "fused_talker_rows", 1)
    monkeypatch.setattr(runner, "wide_talker_rows", 8)
    assert [runner.graph_kv_buckets(b) for b in (1, 2, 4, 8)] == [(0,), (128, 192, 256), (128, 192, 256), (0,)]
    assert runner.graph_kv(1, 200) == 0 and runner.graph_kv(4, 200) == 256 and runner.graph_kv(8, 257) == 0


def test_steps_no_graph_covers_run_eagerly(runner):
    graphs = use_graphs(runner, (1, 2))
    try:
        run(runner, [0, 1, 2], requests(), frames=2)  # 3 rows > the largest graph
        assert graphs.replayed == []
        run(runner, [0], requests(top_p=0.9)[:1], frames=2)  # top-p: the general sampler, eagerly
        assert graphs.replayed == []
        run(runner, [0], requests(top_k=CANDIDATES + 1)[:1], frames=2)
        assert graphs.replayed == []
        run(runner, [0], requests(top_k=CANDIDATES)[:1], frames=2)
        assert len(graphs.replayed) == 2
    finally:
        runner.graphs, runner.graph_buckets = None, ()


def test_batched_prefill_gives_the_codes_of_one_by_one_prefill(runner):
    reqs = requests()
    one_by_one, _ = run(runner, [0, 1, 2], reqs, batched=False)
    batched, _ = run(runner, [0, 1, 2], reqs, batched=True)
    assert np.array_equal(batched, one_by_one)
    # a burst writes straight into its slots, in any order, over whatever earlier requests left there
    runner.kv.k.normal_(), runner.kv.v.normal_()
    spread, _ = run(runner, [5, 0, 3], reqs, batched=True)
    assert np.array_equal(spread, one_by_one)


def test_prefill_many_reports_each_unservable_request_and_serves_the_rest(runner):
    too_long = GenerationRequest(task="CustomVoice", text="word " * 400, speaker="vivian")
    ok = requests()[0]
    results = runner.prefill_many([(0, too_long), (1, ok)])
    assert isinstance(results[0], ValueError) and "--max-model-len" in str(results[0])
    assert not isinstance(results[1], Exception) and runner.lengths[1] > 0
    runner.release(1)


def test_candidate_sampler_draws_what_the_general_sampler_draws():
    gen = torch.Generator().manual_seed(0)
    batch, vocab = 32, 2048
    for _ in range(10):
        logits = torch.randn(batch, vocab, generator=gen) * 3
        params = RowParams(do_sample=torch.rand(batch, generator=gen) > 0.2,
                           temperature=torch.rand(batch, generator=gen) + 0.3,
                           top_k=torch.randint(1, CANDIDATES + 1, (batch,), generator=gen),
                           top_p=torch.ones(batch))
        seed, frame = torch.randint(0, 2**40, (batch,), generator=gen), torch.randint(0, 999, (batch,), generator=gen)
        expected = sample(logits, params, noise=exponential_noise(seed, frame, 3, vocab))
        assert torch.equal(sample_top_candidates(logits, params, seed, frame, 3), expected)
    assert eligible(False, 0, 0.5) and eligible(True, CANDIDATES, 1.0)
    assert not eligible(True, 0, 1.0) and not eligible(True, 50, 0.95) and not eligible(True, CANDIDATES + 1, 1.0)


def test_noise_at_ids_equals_the_full_vocabulary_draws():
    seed, frame = torch.tensor([5, 2**41 + 7]), torch.tensor([0, 12])
    full = exponential_noise(seed, frame, 4, 300)
    ids = torch.tensor([[0, 17, 299], [3, 3, 150]])
    assert torch.equal(exponential_noise_at(seed, frame, 4, ids), full.gather(1, ids))


def test_length_policy_is_a_speaking_rate_model():
    assert speech_seconds("") == pytest.approx(0.4)
    assert speech_seconds("a" * 150) == pytest.approx(10.4)
    assert speech_seconds("你好" * 9) == pytest.approx(4.4)  # 18 CJK characters at 4.5 per second
    assert speech_seconds("hello   world") == speech_seconds("hello world")  # whitespace runs count once
    assert text_frames("Hi.") == 8 and text_frames("") == 5  # ceil(0.6 s x 12.5), ceil(0.4 s x 12.5)
    assert frame_limit("text", "a" * 150, 2048) == 130 and frame_limit("text", "a" * 150, 50) == 50
    assert frame_limit("max-new-tokens", "Hi.", 2048) == 2048
    with pytest.raises(ValueError, match="length policy"):
        frame_limit("words", "Hi.", 10)
    with pytest.raises(ValueError, match="length_policy"):
        EngineConfig(model="x", length_policy="words")


def test_ignore_eos_stops_by_the_text_and_never_samples_eos():
    runner, _codec, _info = load_stages(EngineConfig(model=str(resolve_model("tiny-random")), ignore_eos=True,
                                                     **CONFIG))
    assert bool(runner.suppress[runner.eos_id])
    req = GenerationRequest(task="CustomVoice", text="Hello there, how are you?", speaker="vivian",
                            max_new_tokens=200, sampling=SamplingParams(seed=3))
    _ref, limit = runner.prefill(0, req)
    assert limit == text_frames(req.text)
    codes = [runner.decode_step(1) for _ in range(limit)]
    assert not any(ended[0] for _, ended in codes)
    assert all(c[0, 0] != runner.eos_id for c, _ in codes)
