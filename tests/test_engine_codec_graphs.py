"""The codec's graph path on CPU (serving/engine/codec_graphs.py): buckets, padding, fallback and the memory budget.

CUDA graphs cannot be captured here; on a CPU CodecGraphs registers each bucket and its replay runs the very
function a graph captures (static inputs -> step) eagerly, so a padded call through a bucket must give the
same samples and leave the same slot states as the exact-shape eager call. Different shapes change how
float sums are blocked, so in float32 the two agree to rounding (~1e-6 of full scale); in float64 the samples
are equal and the states agree to 1e-12, which rules out any leak of padding into a row.
"""

import copy

import numpy as np
import pytest
import torch

from serving.engine.codec_graphs import (CodecGraphs, PrimeGraphs, cover, keep_within_budget,
                                         make_batch_buckets, make_frame_buckets, pad_rows, parse_batches)
from serving.engine.codec_stage import CodecChunk, CodecRunner
from serving.engine.engine import EngineConfig
from serving.engine.loader import codec_graph_buckets
from serving.model.codec_config import tiny_codec_config
from serving.model.codec_decoder import CodecDecoder, init_random_

Q = 16
SLOTS = 4
BUCKETS = ((1, 4), (2, 4), (4, 4), (2, 8), (4, 8), (4, 25))


@pytest.fixture(scope="module")
def decoder():
    dec = CodecDecoder(tiny_codec_config().decoder)
    init_random_(dec, torch.Generator().manual_seed(0))
    return dec.eval()


def codes(n, seed):
    return np.random.default_rng(seed).integers(0, 2048, size=(n, Q), dtype=np.int64)


def graph_runner(decoder, buckets=BUCKETS, budget=None):
    runner = CodecRunner(decoder, torch.device("cpu"), Q, SLOTS, graph_buckets=buckets, graph_budget_bytes=budget)
    runner.replayed = []
    replay = runner.graphs.replay
    runner.graphs.replay = lambda bucket, *a: runner.replayed.append(bucket) or replay(bucket, *a)
    return runner


def decode_alike(graphs, eager, steps, dtype, tol):
    """Each step's calls through the graph runner and the eager one: the same samples per chunk (equal in
    float64), the same slot states, and the scratch slot only ever holding zeros."""
    for step in steps:
        got, want = graphs.decode(step), eager.decode(step)
        assert [len(w) for w in got] == [len(c.codes) * graphs.samples_per_frame for c in step]
        for g, w in zip(got, want):
            assert np.array_equal(g, w) if dtype == torch.float64 else np.abs(g - w).max() < 1e-5
        for g, w in zip(slot_states(graphs), slot_states(eager)):
            assert torch.allclose(g[:SLOTS], w[:SLOTS], rtol=tol, atol=tol)
            assert not g[SLOTS].any()


def slot_states(runner):
    return [runner.pool.state.clone(), runner.pool.history.clone()]


def test_frame_buckets_are_the_chunk_sizes_streaming_produces():
    assert make_frame_buckets(4, 25) == (1, 2, 4, 8, 16, 25)  # first, steady, finals / request first chunks
    assert make_frame_buckets(3, 12) == (1, 2, 3, 4, 6, 8, 12)  # 3, 6, 12: the doubling schedule
    assert make_frame_buckets(2, 25) == (1, 2, 4, 8, 16, 25)  # no bucket for a remainder (22 frames) of some plan
    assert make_frame_buckets(25, 25) == (1, 2, 4, 8, 16, 25)
    with pytest.raises(ValueError):
        make_frame_buckets(0, 25)


def test_batch_buckets_default_ladder_flag_and_bad_sizes():
    assert make_batch_buckets(16) == (1, 2, 3, 4, 6, 8, 12, 16)
    assert make_batch_buckets(10) == (1, 2, 3, 4, 6, 8, 10)
    assert make_batch_buckets(64)[-4:] == (24, 32, 48, 64)
    assert make_batch_buckets(16, (8, 1, 8)) == (1, 8)
    assert make_batch_buckets(16, ()) == ()
    with pytest.raises(ValueError, match=r"\[1, 16\]"):
        make_batch_buckets(16, (1, 32))
    assert parse_batches("1, 4,16") == (1, 4, 16) and parse_batches(None) is None and parse_batches("none") == ()
    with pytest.raises(ValueError, match="comma-separated"):
        parse_batches("1;4")
    with pytest.raises(ValueError, match=r"\[1, 64\]"):
        EngineConfig(model="x", codec_graph_batches=(128,))
    with pytest.raises(ValueError, match="codec_graph_memory_gb"):
        EngineConfig(model="x", codec_graph_memory_gb=-1)


def test_loader_captures_codec_graphs_only_on_cuda_without_enforce_eager():
    config = EngineConfig(model="x", first_chunk_frames=4, chunk_frames=25, max_codec_batch=4)
    buckets = codec_graph_buckets(config, torch.device("cuda"))
    assert buckets == tuple((b, f) for b in (1, 2, 3, 4) for f in (1, 2, 4, 8, 16, 25))
    assert codec_graph_buckets(config, torch.device("cpu")) == ()
    eager = EngineConfig(model="x", enforce_eager=True)
    assert codec_graph_buckets(eager, torch.device("cuda")) == ()
    only = EngineConfig(model="x", codec_graph_batches=(16,))
    assert {b for b, _ in codec_graph_buckets(only, torch.device("cuda"))} == {16}


def test_cover_picks_the_cheapest_bucket_that_fits():
    assert cover(BUCKETS, 1, 3) == (1, 4)
    assert cover(BUCKETS, 3, 4) == (4, 4)
    assert cover(BUCKETS, 2, 5) == (2, 8)
    assert cover(BUCKETS, 3, 9) == (4, 25)
    assert cover(BUCKETS, 5, 1) is None and cover(BUCKETS, 1, 26) is None
    assert cover([(4, 8), (8, 4)], 1, 1) == (4, 8)  # equal cost: fewer rows


def test_pad_rows_fills_scratch_rows_and_right_pads_frames():
    a, b = codes(3, 1), codes(1, 2)
    batch, meta = pad_rows([(2, a, True), (0, b, False)], 4, 8, scratch_slot=9, num_quantizers=Q)
    assert batch.shape == (4, 8, Q) and meta.tolist() == [[2, 0, 9, 9], [3, 1, 0, 0], [1, 0, 1, 1]]
    assert np.array_equal(batch[0, :3].numpy(), a) and np.array_equal(batch[1, :1].numpy(), b)
    assert not batch[0, 3:].any() and not batch[1, 1:].any() and not batch[2:].any()


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-4)])
def test_padded_calls_equal_the_exact_eager_calls_samples_and_slot_states(decoder, dtype, tol):
    """Four steps of a stream mix: first chunks of different lengths (scratch rows + right padding), a 1-frame
    final chunk beside a longer one, a reused slot starting afresh, and a steady chunk alone."""
    decoder = copy.deepcopy(decoder).to(dtype)
    graphs, eager = graph_runner(decoder), CodecRunner(decoder, torch.device("cpu"), Q, SLOTS)
    graphs.graphs.capture_all(None)
    steps = [
        [CodecChunk(0, codes(4, 1), True), CodecChunk(1, codes(3, 2), True), CodecChunk(3, codes(2, 3), True)],
        [CodecChunk(1, codes(7, 4), False), CodecChunk(0, codes(1, 5), False)],
        [CodecChunk(3, codes(4, 6), False), CodecChunk(2, codes(2, 7), True), CodecChunk(0, codes(3, 8), True)],
        [CodecChunk(2, codes(25, 9), False)],
    ]
    decode_alike(graphs, eager, steps, dtype, tol)
    assert graphs.replayed == [(4, 4), (2, 8), (4, 4), (4, 25)]


def test_calls_beyond_the_largest_bucket_run_eagerly(decoder):
    runner = graph_runner(decoder, buckets=((2, 4),))
    runner.graphs.capture_all(None)
    eager = CodecRunner(decoder, torch.device("cpu"), Q, SLOTS)
    for step in ([CodecChunk(s, codes(2, s), True) for s in range(3)],  # more rows than any bucket
                 [CodecChunk(0, codes(5, 9), False)]):                    # more frames than any bucket
        for g, w in zip(runner.decode(step), eager.decode(step)):
            assert np.array_equal(g, w)
    assert runner.replayed == []
    runner.decode([CodecChunk(1, codes(3, 4), False)])
    assert runner.replayed == [(2, 4)]


def test_budget_keeps_the_cheapest_buckets_and_drops_the_largest():
    estimate = {(1, 4): 10, (1, 25): 40, (4, 25): 150, (16, 25): 600}
    taken = {(1, 4): 10, (1, 25): 30, (4, 25): 110, (16, 25): 420}  # shared pool: less than the estimates
    order = sorted(estimate, key=estimate.get)
    captured = []

    def capture(bucket):
        captured.append(bucket)
        return taken[bucket]

    assert keep_within_budget(order, estimate.get, capture, None) == (order, [])
    captured.clear()
    kept, dropped = keep_within_budget(order, estimate.get, capture, 200)  # 10 + 30 + 150 fits, + 600 does not
    assert kept == captured == [(1, 4), (1, 25), (4, 25)] and dropped == [(16, 25)]
    assert keep_within_budget(order, estimate.get, capture, 5) == ([], order)


class SizedGraphs(CodecGraphs):
    """Each bucket's estimate and captured memory are batch x frames KiB, as they grow with it on a GPU."""

    def _estimate(self, bucket):
        super()._estimate(bucket)
        return bucket[0] * bucket[1] * 1024

    def _capture(self, bucket):
        self.memory[bucket] = super()._capture(bucket) + bucket[0] * bucket[1] * 1024
        return self.memory[bucket]


def test_runner_under_a_budget_reports_what_it_kept_and_runs_the_rest_eagerly(decoder, caplog):
    runner = CodecRunner(decoder, torch.device("cpu"), Q, SLOTS, graph_budget_bytes=40 * 1024)
    runner.graphs = SizedGraphs(runner.pool, list(BUCKETS), Q, torch.device("cpu"))
    with caplog.at_level("INFO", logger="serving.engine"):
        runner.warmup((4,))
    report = runner.graph_report
    # cheapest first: 1x4 (4 KiB), 2x4 (8), 2x8 (16) take 28 KiB and their inputs; 4x4 (16) would pass 40
    assert [(b, f) for b, f, _ in report.graphs] == [(1, 4), (2, 4), (2, 8)]
    assert report.dropped == ((4, 4), (4, 8), (4, 25)) and report.budget_bytes == 40 * 1024
    assert report.total_bytes == sum(m for _, _, m in report.graphs) > 28 * 1024
    assert "dropped 3 bucket(s)" in caplog.text and "4x4, 4x8, 4x25" in caplog.text
    assert "3 captured" in caplog.text and "2x8 0.0" in caplog.text
    described = runner.describe()
    assert described["codec_graph_memory_bytes"] == report.total_bytes
    assert described["codec_graphs_dropped"] == [[4, 4], [4, 8], [4, 25]]
    assert runner.graphs.covering(2, 5) == (2, 8) and runner.graphs.covering(3, 1) is None  # dropped: eager
    out = runner.decode([CodecChunk(s, codes(2 + s, s), True) for s in range(3)])
    assert [len(w) for w in out] == [(2 + s) * decoder.samples_per_frame for s in range(3)]


def test_engine_reports_codec_dtype_and_graphs(decoder):
    """--codec-dtype reaches the decoder; GET /health's engine dict (config_dict) carries the codec's graphs,
    none on a CPU, and EngineInfo says the codec is eager."""
    import asyncio

    from serving.engine.checkpoint import resolve_model
    from serving.engine.engine import Engine

    async def started():
        engine = Engine(EngineConfig(model=str(resolve_model("tiny-random")), max_batch_size=2, max_model_len=64,
                                     codec_dtype="bfloat16", codec_graph_memory_gb=0.5))
        await engine.start()
        try:
            wav = await asyncio.get_running_loop().run_in_executor(
                engine._codec_pool, engine.codec.decode, [CodecChunk(0, codes(3, 1), True)])
            return engine.config_dict(), engine.info, wav[0]
        finally:
            await engine.shutdown()

    described, info, wav = asyncio.run(started())
    assert described["codec_dtype"] == "bfloat16" and described["codec_graphs"] == []
    assert described["codec_graph_memory_bytes"] == 0 and described["codec_graph_budget_bytes"] == 2**29
    assert described["codec_graph_memory_gb"] == 0.5 and described["codec_slots"] >= 2
    assert info.codec_graphs is None
    assert wav.dtype == np.float32 and wav.shape == (3 * 1920,) and np.isfinite(wav).all()


def test_priming_replays_its_shapes_graph_with_the_eager_result(decoder):
    """A new voice's priming goes through the graph of its padded shape (warm-up makes one per shape it met) and
    leaves the slot states an eager priming leaves; the stream then sounds the same. A reference longer than
    warm-up met (no graph) primes eagerly. In float64, where the decode buckets' padding changes no sample."""
    decoder = copy.deepcopy(decoder).to(torch.float64)
    graphs, eager = graph_runner(decoder), CodecRunner(decoder, torch.device("cpu"), Q, SLOTS)
    for runner in (graphs, eager):
        runner.warmup((4,), prime_frames=64)
    assert eager.prime_graphs is None
    assert graphs.describe()["codec_prime_graphs"] == [[r, f] for r in (1, 2, 4) for f in (32, 64)]
    ran = []
    run = graphs.prime_graphs.run
    graphs.prime_graphs.run = lambda codes, slots, lengths: ran.append((len(slots), codes.shape[1], run(
        codes, slots, lengths))) or ran[-1][2]
    steps = [
        [CodecChunk(0, codes(4, 1), True, prime=codes(40, 2)), CodecChunk(1, codes(4, 3), True, prime=codes(9, 4)),
         CodecChunk(2, codes(4, 5), True)],
        [CodecChunk(3, codes(2, 6), True, prime=codes(70, 7))],  # 96 frames padded: beyond warm-up's shapes
    ]
    for step in steps:
        for g, w in zip(graphs.decode(step), eager.decode(step)):
            assert np.array_equal(g, w)
        for g, w in zip(slot_states(graphs), slot_states(eager)):
            assert torch.allclose(g, w, rtol=1e-12, atol=1e-12)
    assert ran == [(2, 64, True), (1, 96, False)]


def test_a_priming_graphs_padding_rows_leave_other_slots_alone(decoder):
    """Static buffers keep the last call's rows: a call of fewer references through the same shape must pad
    with the scratch slot, not re-prime the slot the previous call's last row named."""
    pool = CodecRunner(decoder, torch.device("cpu"), Q, SLOTS).pool
    reference = CodecRunner(decoder, torch.device("cpu"), Q, SLOTS).pool
    prime_graphs = PrimeGraphs(pool, pool.prime_shapes(32), Q, torch.device("cpu"))
    refs = [torch.from_numpy(codes(20 + i, 30 + i)) for i in range(4)]
    assert prime_graphs.run(*pool.prime_batch([(slot, refs[slot]) for slot in range(4)]))
    pool.decode([(3, torch.from_numpy(codes(5, 40)), False)])  # slot 3's stream moves on
    moved_on = pool.snapshot(3)
    assert prime_graphs.run(*pool.prime_batch([(slot, refs[3 - slot]) for slot in range(3)]))  # 3 rows pad to 4
    reference.prime([(slot, refs[3 - slot]) for slot in range(3)])
    for slot in range(3):
        assert all(torch.equal(a, b) for a, b in zip(pool.snapshot(slot), reference.snapshot(slot)))
    assert all(torch.equal(a, b) for a, b in zip(pool.snapshot(3), moved_on))
    assert not any(s.any() for s in pool.snapshot(pool.scratch_slot))


def test_frames_computed_count_the_padding_of_the_shape_each_call_runs(decoder):
    """/metrics' codec frames: a call of 3 rows with chunks of 3, 2 and 1 frames runs the (4, 4) graph, 16 frames
    computed for 6 decoded, 4 of them a row that only fills the batch; a call beyond every shape runs its own (2 x
    30); warm-up's calls are not counted."""
    runner = graph_runner(copy.deepcopy(decoder))
    runner.warmup((4,))
    assert (runner.frames_decoded, runner.frames_computed, runner.frames_padding_rows) == (0, 0, 0)
    runner.decode([CodecChunk(0, codes(3, 1), True), CodecChunk(1, codes(2, 2), True), CodecChunk(2, codes(1, 3), True)])
    assert runner.replayed == [(4, 4)]
    assert (runner.frames_decoded, runner.frames_computed, runner.frames_padding_rows) == (6, 16, 4)  # 1 row x 4
    runner.decode([CodecChunk(0, codes(30, 4), False), CodecChunk(1, codes(5, 5), False)])
    assert runner.replayed == [(4, 4)]
    assert (runner.frames_decoded, runner.frames_computed, runner.frames_padding_rows) == (41, 76, 4)
