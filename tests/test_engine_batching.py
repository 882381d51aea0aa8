"""The talker stage and the engine on a tiny random checkpoint: exact codes in any batch, cancellation."""

import asyncio
import contextlib
import time

import numpy as np
import pytest
import torch

from serving.engine.checkpoint import resolve_model
from serving.engine.cuda_graphs import PrefillGraphs
from serving.engine.engine import Engine, EngineConfig, RequestFailed
from serving.engine.loader import load_stages
from serving.engine.mailbox import Mailbox
from serving.engine.request import GenerationRequest, SamplingParams
from serving.model.tts import Qwen3TTS

CONFIG = dict(max_batch_size=4, max_model_len=128, chunk_frames=4, first_chunk_frames=2, left_context_frames=4)


@pytest.fixture(scope="module")
def stages():
    runner, codec, info = load_stages(EngineConfig(model=str(resolve_model("tiny-random")), **CONFIG))
    return runner, codec, info


def requests():
    return [
        GenerationRequest(task="CustomVoice", text="Hello there.", speaker="vivian", max_new_tokens=6,
                          sampling=SamplingParams(seed=1)),
        GenerationRequest(task="CustomVoice", text="A longer sentence, with more words in it.", speaker="ryan",
                          language="english", max_new_tokens=6,
                          sampling=SamplingParams(seed=2, temperature=0.3, top_k=5, repetition_penalty=1.3)),
        GenerationRequest(task="CustomVoice", text="Greedy.", speaker="dylan", language="chinese", max_new_tokens=6,
                          sampling=SamplingParams(seed=3, do_sample=False, subtalker_do_sample=False)),
    ]


def run_frames(runner, slots_and_requests, frames):
    out = {slot: [] for slot, _ in slots_and_requests}
    for slot, req in slots_and_requests:
        runner.prefill(slot, req)
    bucket = max(out) + 1
    bucket = min(b for b in runner.buckets if b >= bucket)
    for _ in range(frames):
        codes, _ended = runner.decode_step(bucket)
        for slot in out:
            out[slot].append(codes[slot])
    for slot in out:
        runner.release(slot)
    return {slot: np.stack(v) for slot, v in out.items()}


def test_codes_of_a_request_are_the_same_alone_or_in_any_batch_and_slot(stages):
    runner = stages[0]
    reqs = requests()
    alone = [run_frames(runner, [(0, r)], 5)[0] for r in reqs]
    batched = run_frames(runner, [(3, reqs[0]), (1, reqs[1]), (0, reqs[2])], 5)
    assert np.array_equal(batched[3], alone[0])
    assert np.array_equal(batched[1], alone[1])
    assert np.array_equal(batched[0], alone[2])
    assert alone[0].shape == (5, 16) and not np.array_equal(alone[0], alone[1])
    assert ((alone[0] >= 0) & (alone[0] < 2048)).all()


def staged_schedule(runner, stage: bool, frames: int = 6, join_at: int = 2,
                    prefill_at: int | None = None) -> dict[int, np.ndarray]:
    """A request decoding in slot 0 and one admitted into slot 2 after `join_at` of its frames: staged with the next
    step, or (stage False) prefilled before step `prefill_at` (default: the step after), as prefill_many would (the
    schedule a staged request's codes must match: the step it rides where that step carries its prompt, else the
    step after, since it sits the step it rides out). Steps cover 4 slots throughout; returns each request's codes
    from its first step on (a staged one's from the first step the launch does not say it sat out)."""
    first, second = requests()[0], requests()[1]
    prefill_at = join_at + 1 if prefill_at is None else prefill_at
    runner.prefill_many([(0, first)])
    out = {0: [], 2: []}
    for frame in range(frames + 1):
        if frame == join_at and stage:
            results, staged = runner.stage([(2, second)])
            assert staged and not isinstance(results[0], Exception)
        if frame == prefill_at and not stage:
            runner.prefill_many([(2, second)])
        handle = runner.launch(4)
        codes, _ = runner.collect(handle)
        out[0].append(codes[0])
        if (frame >= join_at and 2 not in handle.sat_out) if stage else frame >= prefill_at:
            out[2].append(codes[2])
    runner.release(0, 2)
    return {slot: np.stack(codes) for slot, codes in out.items()}


def test_a_staged_request_sits_out_the_step_it_rides_and_then_has_its_own_codes(stages):
    """An admission staged while a step is in flight (TalkerRunner.stage) is prefilled with the next launch, here
    where that step cannot carry its prompt (on the CPU, no wide layers: after the step, on its stream), and set
    up after it: the running request's codes are unchanged, and the new one's are those of a prefill before the
    step after (its row in the step it rides is an empty slot's: the launch says it sat out)."""
    runner = stages[0]
    assert not runner.takes_prompts(4)  # no wide talker layers on a CPU: the passes follow the step
    staged, prefilled = staged_schedule(runner, stage=True), staged_schedule(runner, stage=False)
    np.testing.assert_array_equal(staged[0], prefilled[0])
    np.testing.assert_array_equal(staged[2], prefilled[2])
    assert staged[2].shape == (4, 16) and not np.array_equal(staged[2], staged[0][3:])


def test_a_burst_admitted_beside_a_step_is_prefilled_at_once_and_joins_it(stages, monkeypatch):
    """An admission of more than STAGE_MAX_POSITIONS positions (a burst) is not staged: stage() prefills it before
    the step, as prefill_many would, and its requests join that step (the schedule of stage False in
    staged_schedule, one step earlier)."""
    import serving.engine.talker_stage as talker_stage

    runner = stages[0]
    monkeypatch.setattr(talker_stage, "STAGE_MAX_POSITIONS", 4)  # the admission's prompt is longer: a burst
    first, second = requests()[0], requests()[1]
    runner.prefill_many([(0, first)])
    codes = []
    for frame in range(5):
        if frame == 2:
            results, staged = runner.stage([(2, second)])
            assert not staged and not runner._staged and not isinstance(results[0], Exception)
        codes.append(runner.decode_step(4)[0])
    runner.release(0, 2)
    want = staged_schedule(runner, stage=False, frames=4, join_at=1)
    np.testing.assert_array_equal(np.stack(codes)[:, 0], want[0][:5])
    np.testing.assert_array_equal(np.stack(codes)[2:, 2], want[2])


def test_a_wide_step_carries_any_staged_admission_in_the_fewest_prompt_rows(monkeypatch):
    """Every admission that is staged (up to STAGE_MAX_POSITIONS positions: a voice clone's prompt holds its
    reference's codes, ~65 positions, and 11 of them came at once at 128 streams of short text) fits the prompt rows
    of one wide step, padded to the next size; the padding rows continue the last prompt's positions in its slot.
    One more position than that is not carried (its passes follow the step)."""
    import types

    import serving.engine.talker_stage as talker_stage

    runner, _, _ = load_stages(EngineConfig(model=str(resolve_model("tiny-random")), **{
        **CONFIG, "max_model_len": 2048}))
    monkeypatch.setattr(runner, "wide_talker", object())  # the wide layers' presence is all the choice reads
    runner.wide_talker_rows = 3
    runner.set_up_prompt_rows()
    assert runner.step_prompt_rows[-1] == talker_stage.STAGE_MAX_POSITIONS and runner.takes_prompts(4)
    hidden = runner.talker.cfg.transformer.hidden_size

    def staged(*lengths):
        return [(slot, None, types.SimpleNamespace(prefill=torch.full((n, hidden), float(slot))))
                for slot, n in enumerate(lengths)]

    assert runner._stage_prompt_rows(staged(65, 65, 70), bucket=4) == 256
    assert runner._stage_prompt_rows(staged(300, 300, 100), bucket=4) == 768
    slots, pos = runner._prompt_slots[:768].tolist(), runner._prompt_pos[:768, 0].tolist()
    assert slots[:300] == [0] * 300 and slots[600:] == [2] * 168
    assert pos[299:302] == [299, 0, 1] and pos[600:] == list(range(168))
    assert runner._prompt_x[599, 0] == 1 and runner._prompt_x[699, 0] == 2 and not runner._prompt_x[700:768].any()
    assert runner._stage_prompt_rows(staged(512, 512), bucket=4) == 1024
    assert runner._stage_prompt_rows(staged(512, 513), bucket=4) == 0
    assert runner._stage_prompt_rows(staged(10), bucket=2) == 0  # fewer rows than the wide layers take


def test_a_staged_request_whose_client_left_is_not_set_up(stages):
    """A slot freed between its staging and the launch (the client left) is neither prefilled nor set up."""
    runner = stages[0]
    runner.stage([(1, requests()[0])])
    runner.release(1)
    runner.decode_step(4)
    assert not runner.active.any() and runner.lengths[:4] == [0] * 4


def test_an_admission_sets_up_every_slot_from_its_request_and_prompt(stages):
    """prefill_many writes all its slots at once (two uploads, one write of all trailing text): each slot holds its
    own prompt's position and streamed text, its request's seed and sampling of every kind, whatever the slots
    held before, and a slot's release clears what the next step reads."""
    runner = stages[0]
    streamed = [GenerationRequest(task="CustomVoice", text=text, speaker="ryan", max_new_tokens=6,
                                  non_streaming_mode=False, sampling=SamplingParams(seed=7 + i, temperature=0.5 + i,
                                                                                    top_k=3 + i, top_p=0.8))
                for i, text in enumerate(("Streamed in, word by word.", "A much longer line of text that goes on, "
                                                                        "and on, as the frames go by."))]
    reqs = streamed + requests()[1:]
    runner.prefill_many([(slot, reqs[-1 - slot]) for slot in range(4)])  # other requests' state first
    runner.decode_step(4)
    runner.release(0, 1, 2, 3)
    placed = [(3, reqs[0]), (0, reqs[1]), (2, reqs[2]), (1, reqs[3])]
    prompts = [built[0] for built in runner.prompts.build_many([r for _, r in placed], lambda key, compute: compute())]
    results = runner.prefill_many(placed)
    assert not any(isinstance(r, Exception) for r in results)
    for (slot, req), prompt in zip(placed, prompts):
        sp, n, t = req.sampling, prompt.prefill.shape[0], prompt.trailing.shape[0]
        assert runner.lengths[slot] == int(runner.pos[slot]) == n and int(runner.trailing_len[slot]) == t
        assert torch.equal(runner.trailing[slot, :t], prompt.trailing.to(runner.trailing.dtype))
        assert (int(runner.active[slot]), int(runner.generated[slot]), bool(runner.seen[slot].any())) == (1, 0, False)
        assert int(runner.seed[slot]) == sp.seed and float(runner.rep_penalty[slot]) == pytest.approx(
            sp.repetition_penalty)
        for params, (do_sample, temperature, top_k, top_p) in (
                (runner.talker_params, (sp.do_sample, sp.temperature, sp.top_k, sp.top_p)),
                (runner.cp_params, (sp.subtalker_do_sample, sp.subtalker_temperature, sp.subtalker_top_k,
                                    sp.subtalker_top_p))):
            assert bool(params.do_sample[slot]) == do_sample and int(params.top_k[slot]) == top_k
            assert float(params.temperature[slot]) == pytest.approx(temperature)
            assert float(params.top_p[slot]) == pytest.approx(top_p)
    assert int(runner.trailing_len[3]) > 3 and int(runner.trailing_len[0]) > int(runner.trailing_len[3])
    runner.release(0, 1, 2, 3)
    assert not runner.active.any() and not runner.pos.any() and runner.lengths[:4] == [0] * 4


def test_a_moved_request_goes_on_with_the_codes_it_would_have_had_in_place(stages):
    """Compaction moves a running request to a lower slot between steps: every piece of its state goes with it
    (caches, history, sampling, trailing text), its old slot is freed, and a request beside it is untouched.
    The slot it moves into held another request until that one ended, so nothing it left behind may matter."""
    runner = stages[0]
    moved = GenerationRequest(task="CustomVoice", text="Streamed in, word by word, as the frames go.",
                              speaker="ryan", max_new_tokens=8, non_streaming_mode=False,
                              sampling=SamplingParams(seed=2, temperature=0.7, top_k=9, repetition_penalty=1.5))
    beside, before = requests()[0], requests()[2]
    alone = [run_frames(runner, [(0, r)], 7)[0] for r in (moved, beside)]
    runner.prefill(2, before)
    runner.decode_step(4), runner.decode_step(4)
    runner.prefill(3, moved), runner.prefill(1, beside)
    first = [runner.decode_step(4)[0] for _ in range(3)]
    runner.release(2)
    state = lambda slot: [t[slot].clone() for t in (  # noqa: E731
        runner.hidden, runner.pos, runner.generated, runner.seen, runner.trailing, runner.trailing_len, runner.seed,
        runner.rep_penalty, *vars(runner.talker_params).values(), *vars(runner.cp_params).values())]
    written = runner.lengths[3]
    keys = lambda slot: [c[:, slot, :, :written].clone() for c in (runner.kv.k, runner.kv.v)]  # noqa: E731
    held = state(3) + keys(3)
    runner.move([(3, 2)])
    assert all(torch.equal(a, b) for a, b in zip(held, state(2) + keys(2), strict=True))
    assert (runner.lengths[3], int(runner.active[3]), int(runner.pos[3])) == (0, 0, 0)
    assert runner.lengths[2] == int(runner.pos[2]) and int(runner.trailing_len[2]) > 3
    later = [runner.decode_step(3)[0] for _ in range(2)]
    # as the engine does it: a move queued while a step is in flight (the moved row's codes come at its old slot)
    inflight = runner.launch(3)
    runner.move([(2, 0)])
    following = runner.launch(3)
    last = [runner.collect(inflight)[0], runner.collect(following)[0]]
    runner.release(1), runner.release(0)
    assert np.array_equal(np.stack([c[3] for c in first] + [c[2] for c in later] + [last[0][2], last[1][0]]),
                          alone[0])
    assert np.array_equal(np.stack([c[1] for c in first + later + last]), alone[1])


def test_seed_decides_the_codes(stages):
    runner = stages[0]
    req = requests()[0]
    other = GenerationRequest(task="CustomVoice", text=req.text, speaker="vivian", max_new_tokens=6,
                              sampling=SamplingParams(seed=99))
    assert not np.array_equal(run_frames(runner, [(0, req)], 4)[0], run_frames(runner, [(0, other)], 4)[0])
    assert np.array_equal(run_frames(runner, [(0, req)], 4)[0], run_frames(runner, [(2, req)], 4)[2])


def test_a_slot_is_freed_on_the_talker_stream(stages, monkeypatch):
    """release() runs on the event loop's thread, whose current stream is the default one, where the codec's
    kernels queue: its writes must go on the talker's stream, or they could land after the slot's next
    prefill (which runs there) and zero the new request's position. The writes happen inside _on_stream."""
    runner = stages[0]
    runner.prefill(1, requests()[0])
    inside = []

    @contextlib.contextmanager
    def on_stream():
        yield
        inside.append((int(runner.active[1]), int(runner.pos[1])))

    monkeypatch.setattr(runner, "_on_stream", on_stream)
    runner.release(1)
    assert inside == [(0, 0)] and runner.lengths[1] == 0


def test_slots_are_set_up_and_freed_without_host_scalar_writes(stages, monkeypatch):
    """`t[i] = 0` into a CUDA tensor copies the 0 from pageable host memory, which first waits for the stream:
    freeing a finished request's slot that way held the engine's loop until the decode step in flight was done
    (H100, docs/performance.md, eighteenth pass). A CPU has no stream to wait for, so this checks the form:
    prefill, moves and release write the runner's tensors with kernels (zero_, index_fill_) or device tensors only."""
    runner = stages[0]
    scalar_writes = []
    setitem = torch.Tensor.__setitem__

    def checked(self, index, value):
        if isinstance(value, (bool, int, float)):
            scalar_writes.append((tuple(self.shape), index))
        return setitem(self, index, value)

    # through a prefill graph (run eagerly on a CPU) and the batched pass for the prompt no bucket holds
    monkeypatch.setattr(runner, "prefill_graphs", PrefillGraphs(runner.talker.model, runner.kv, ((1, 32),),
                                                                runner.device, runner.dtype))
    monkeypatch.setattr(torch.Tensor, "__setitem__", checked)
    results = runner.prefill_many([(2, requests()[0]), (3, requests()[1])])
    assert not any(isinstance(r, Exception) for r in results)
    assert [int(runner.active[slot]) for slot in (2, 3)] == [1, 1]
    runner.move([(3, 0)])
    runner.release(2), runner.release(0)
    assert scalar_writes == []
    assert [(int(runner.active[slot]), int(runner.pos[slot])) for slot in (0, 2, 3)] == [(0, 0)] * 3


def test_a_prompt_longer_than_the_slot_is_refused(stages):
    runner = stages[0]
    long = GenerationRequest(task="CustomVoice", text="word " * 400, speaker="vivian", max_new_tokens=4)
    with pytest.raises(ValueError, match="max-model-len"):
        runner.prefill(0, long)
    runner.release(0)


@pytest.mark.parametrize("burst", [False, True])
def test_a_request_that_arrives_while_others_decode_is_staged_and_its_audio_is_its_own(burst, monkeypatch):
    """The engine stages a request admitted while a step is in flight beside a running one (its prefill rides the
    next launch, which on a CPU, without wide layers, it sits out), or, a burst (STAGE_MAX_POSITIONS monkeypatched
    below its prompt), lets the runner prefill it at once and run it in that step; both requests' audio equals
    their audio alone, and a request admitted into an idle engine is prefilled on its own (no step to ride)."""
    import serving.engine.talker_stage as talker_stage

    if burst:
        monkeypatch.setattr(talker_stage, "STAGE_MAX_POSITIONS", 4)
    calls = []

    def request(seed, frames):
        return GenerationRequest(task="CustomVoice", text=f"Request number {seed}.", speaker="ryan",
                                 max_new_tokens=frames, sampling=SamplingParams(seed=seed))

    async def audio(stream):
        return np.concatenate([c async for c in stream])

    async def main():
        engine = Engine(EngineConfig(model=str(resolve_model("tiny-random")), max_queue=2, **CONFIG))
        await engine.start()
        stage = engine.runner.stage
        engine.runner.stage = lambda items: calls.append(len(items)) or stage(items)
        try:
            alone = [await audio(await engine.submit(request(seed, n))) for seed, n in ((1, 30), (2, 8))]
            assert calls == []
            running = await engine.submit(request(1, 30))
            first = await running.__anext__()  # it decodes: steps are in flight
            later = await audio(await engine.submit(request(2, 8)))
            return alone, [np.concatenate([first, await audio(running)]), later]
        finally:
            await engine.shutdown()

    alone, together = asyncio.run(main())
    assert calls == [1]
    for got, want in zip(together, alone):
        assert len(got) == len(want) and np.abs(got - want).max() < 1e-5


def test_engine_cancel_frees_the_slot_and_others_go_on():
    async def main():
        engine = Engine(EngineConfig(model=str(resolve_model("tiny-random")), max_queue=1, **CONFIG))
        await engine.start()
        try:
            long = await engine.submit(GenerationRequest(task="CustomVoice", text="Long.", speaker="vivian",
                                                   max_new_tokens=100, sampling=SamplingParams(seed=1)))
            short = await engine.submit(GenerationRequest(task="CustomVoice", text="Short.", speaker="ryan",
                                                    max_new_tokens=3, sampling=SamplingParams(seed=2)))
            first = await long.__anext__()
            assert len(first) == 2 * 1920
            long.cancel()
            chunks = [c async for c in short]
            assert sum(len(c) for c in chunks) == 3 * 1920
            for _ in range(100):
                if engine.stats()["running"] == 0:
                    break
                await asyncio.sleep(0.02)
            stats = engine.stats()
            assert stats["running"] == 0 and stats["kv_slots_free"] == 4 and long.frames < 100
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_the_engine_steps_while_the_callers_loop_is_busy():
    """The engine runs on its own loop: a handler that holds the server's loop (parsing a burst's bodies, say)
    does not hold up the talker's steps, and the stream's audio waits for its reader."""
    async def main():
        engine = Engine(EngineConfig(model=str(resolve_model("tiny-random")), **CONFIG))
        await engine.start()
        try:
            stream = await engine.submit(GenerationRequest(task="CustomVoice", text="Busy.", speaker="vivian",
                                                           max_new_tokens=30, sampling=SamplingParams(seed=3)))
            first = await stream.__anext__()
            before = engine.stats()["frames_total"]
            time.sleep(1.0)  # the caller's loop is busy: nothing on it runs
            during = engine.stats()["frames_total"] - before
            rest = [c async for c in stream]
            return during, sum(len(c) for c in [first, *rest])
        finally:
            await engine.shutdown()

    during, samples = asyncio.run(main())
    assert during >= 1 and samples == 30 * 1920


def test_shutdown_twice_and_before_start():
    async def main():
        engine = Engine(EngineConfig(model=str(resolve_model("tiny-random")), **CONFIG))
        await engine.shutdown()  # never started: nothing to stop
        await engine.start()
        await engine.shutdown()
        await engine.shutdown()
        return engine.ready

    assert asyncio.run(main()) is False


def test_a_client_that_leaves_during_its_submission_leaves_nothing_running():
    """submit() hands the request to the engine's loop and waits; a handler cancelled meanwhile (its client left)
    never gets the stream to cancel, so submit cancels it: whether the engine had queued it or not, nothing of
    it goes on, and the slots serve the next request."""
    async def main():
        engine = Engine(EngineConfig(model=str(resolve_model("tiny-random")), **CONFIG))
        await engine.start()
        try:
            left = []
            for seed in range(4):
                task = asyncio.get_running_loop().create_task(engine.submit(GenerationRequest(
                    task="CustomVoice", text="Gone.", speaker="vivian", max_new_tokens=100,
                    sampling=SamplingParams(seed=seed))))
                await asyncio.sleep(0)  # it is waiting on the engine's loop
                task.cancel()
                left.append(task)
            assert all(isinstance(r, asyncio.CancelledError)
                       for r in await asyncio.gather(*left, return_exceptions=True))
            for _ in range(2):  # every callback queued on the engine's loop so far has run
                await engine._on_engine_loop(asyncio.sleep(0))
            live = [s for s in list(engine.scheduler.waiting) + [s for _, s in engine.scheduler.running()]
                    if not s.cancelled]
            after = [c async for c in await engine.submit(GenerationRequest(
                task="CustomVoice", text="Next.", speaker="ryan", max_new_tokens=3, sampling=SamplingParams(seed=9)))]
            return live, sum(len(c) for c in after)
        finally:
            await engine.shutdown()

    live, samples = asyncio.run(main())
    assert live == [] and samples == 3 * 1920


def test_the_checkpoints_generation_config_reaches_the_api(tmp_path):
    """The request defaults the server announces come from the loaded checkpoint's generation_config.json."""
    import json
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(resolve_model("tiny-random"), ckpt)
    config = json.loads((ckpt / "generation_config.json").read_text())
    config.update(temperature=0.55, top_k=7, subtalker_dosample=False)
    (ckpt / "generation_config.json").write_text(json.dumps(config))
    _runner, _codec, info = load_stages(EngineConfig(model=str(ckpt), **CONFIG))
    assert (info.generation.temperature, info.generation.top_k, info.generation.subtalker_dosample) == (0.55, 7, False)


def test_a_step_launched_past_a_requests_end_never_reaches_the_next_request_in_its_slot():
    """The engine launches step N+1 before it reads step N, so a request that ends at N runs one more frame in
    its slot; with one slot the next request is prefilled into that slot right after. Its audio must equal
    its audio alone, and the one that ran to the end of its KV slot (max_model_len - prompt - 1 frames, the
    spare position takes the extra frame's key) must end cleanly."""
    async def audio(engine, request):
        return np.concatenate([c async for c in await engine.submit(request)])

    def fills_the_slot():
        return GenerationRequest(task="CustomVoice", text="Fill it.", speaker="vivian", max_new_tokens=63,
                                 sampling=SamplingParams(seed=4))

    def follower():
        return GenerationRequest(task="CustomVoice", text="After it.", speaker="ryan", max_new_tokens=5,
                                 sampling=SamplingParams(seed=5))

    async def main():
        config = {**CONFIG, "max_batch_size": 1, "max_model_len": 64}
        engine = Engine(EngineConfig(model=str(resolve_model("tiny-random")), max_queue=2, **config))
        await engine.start()
        try:
            alone = await audio(engine, follower())
            first, second = await asyncio.gather(audio(engine, fills_the_slot()), audio(engine, follower()))
            prompt = engine.runner.prompts.build_many([fills_the_slot()], lambda key, compute: compute())[0][0].prefill
            return alone, first, second, prompt.shape[0]
        finally:
            await engine.shutdown()

    alone, first, second, prompt_len = asyncio.run(main())
    assert len(first) == (64 - prompt_len - 1) * 1920
    # equal to float32 rounding: on a loaded machine the follower's first chunk can share a codec call with the
    # first request's last one, and a batch's padding changes how sums are blocked (a wrong frame differs by ~0.1)
    assert len(alone) == 5 * 1920 and np.abs(second - alone).max() < 1e-5


SHORT_FRAMES = (10, 3, 3)  # the wave's first three requests, in slots 0, 1, 2; the long one (24 frames) takes 3


def _drain(move=None):
    """Three shorter requests and a long one after them, submitted at once to an engine of 4 slots. However the
    submissions fall across the talker's steps, the requests in slots 1 and 2 end first, which leaves slots 0
    and 3 running: the long one moves to slot 1, and once slot 0's request ends, to slot 0; no other request
    moves. Returns the long one's audio alone, the wave's audio (or errors), the long one's audio after the
    wave, and the engine's slot moves."""
    def request(seed, frames):
        return GenerationRequest(task="CustomVoice", text=f"Request {seed}.", speaker="vivian",
                                 max_new_tokens=frames, sampling=SamplingParams(seed=seed))

    async def audio(engine, req):
        try:
            return np.concatenate([c async for c in await engine.submit(req)])
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return exc

    async def main():
        engine = Engine(EngineConfig(model=str(resolve_model("tiny-random")), max_queue=4, **CONFIG))
        await engine.start()
        try:
            alone = await audio(engine, request(9, 24))
            if move is not None:
                engine.runner.move = move
            wave = await asyncio.gather(*(audio(engine, request(seed, n)) for seed, n in enumerate(SHORT_FRAMES)),
                                        audio(engine, request(9, 24)))
            after = await audio(engine, request(9, 24))
            return alone, wave, after, engine.stats()["slot_moves_total"]
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def test_the_last_request_of_a_draining_wave_moves_down_and_its_audio_is_unchanged():
    alone, wave, after, moves = _drain()
    assert moves == 2
    assert [len(a) for a in wave[:3]] == [n * 1920 for n in SHORT_FRAMES]
    assert len(wave[3]) == len(alone) == 24 * 1920 and np.abs(wave[3] - alone).max() < 1e-5


def test_a_failed_move_fails_the_moved_request_and_the_engine_goes_on():
    def broken(moves):
        raise RuntimeError("device lost")

    alone, wave, after, moves = _drain(move=broken)
    assert moves == 0
    assert [len(a) for a in wave[:3]] == [n * 1920 for n in SHORT_FRAMES]
    assert isinstance(wave[3], RequestFailed) and "generation failed" in str(wave[3])
    assert np.abs(after - alone).max() < 1e-5


def test_start_up_admits_a_burst_into_every_slot_and_leaves_them_as_it_found_them(monkeypatch):
    """warmup() admits a burst of requests into every slot (a process's first burst pays for first allocations
    and the shared prompt pieces), then frees them: a request afterwards gets the codes it gets from a runner that
    skipped the burst, in any slot."""
    config = EngineConfig(model=str(resolve_model("tiny-random")), **CONFIG)
    (warmed, _, _), (cold, _, _) = load_stages(config), load_stages(config)
    admitted = []
    prefill_many = warmed.prefill_many
    monkeypatch.setattr(warmed, "prefill_many", lambda items: admitted.append(
        [req.task for _, req in items]) or prefill_many(items))
    warmed.warmup()
    monkeypatch.setattr(cold, "_warm_up_admission", lambda: None)
    cold.warmup()
    assert admitted == [["CustomVoice"] * warmed.num_slots] and "admission" in warmed.warmup_s
    assert not warmed.active.any() and not warmed.pos.any()
    reqs = requests()
    placed = [(3, reqs[0]), (1, reqs[1]), (0, reqs[2])]
    got, want = run_frames(warmed, placed, 5), run_frames(cold, placed, 5)
    assert all(np.array_equal(got[slot], want[slot]) for slot, _ in placed)


@pytest.mark.parametrize("kind", ["custom_voice", "base", "voice_design"])
def test_warm_up_requests_cover_the_checkpoints_speakers_languages_and_voices(tmp_path, kind):
    from serving.model.checkpoint import write_checkpoint

    ckpt = write_checkpoint(tmp_path / kind, "tiny", kind, seed=1)
    runner, _, _ = load_stages(EngineConfig(model=str(ckpt), **CONFIG | {"max_model_len": 512}))
    cfg = runner.prompts.cfg
    pairs = len(cfg.languages) * (len(cfg.speakers) if kind == "custom_voice" else 1)
    reqs = runner.prompts.warm_up_requests(2 * pairs)
    assert len({(r.speaker, r.language) for r in reqs}) == pairs and len({r.text for r in reqs}) == 2
    if kind == "base":
        assert sum(r.encoded_voice is not None for r in reqs) == sum(r.speaker_embedding is not None for r in reqs)
    results = runner.prefill_many(list(enumerate(reqs[:runner.num_slots])))
    assert not any(isinstance(r, ValueError) for r in results)


def test_a_lone_streams_chunks_go_as_they_come_due():
    """With no other stream to share a codec call, a chunk whose listener has audio in hand goes when it comes
    due: held for company that cannot come (codec_batch_wait_ms), a lone stream's middle chunks ran at its end,
    one after another before its last (H100: 7-12 ms between the last frame and the last chunk's call). Stage
    stubs (benchmarks/host_overhead.py) make the talker 16x real time, so those chunks have ~0.5-1 s in hand."""
    from unittest import mock

    from benchmarks.host_overhead import StubCodec, StubTalker, _info
    from serving.engine.codec_graphs import make_frame_buckets

    frames = 35  # chunks of 2, 4, 8, 16 and 5 frames
    config = EngineConfig(model="stub", max_batch_size=1)
    talker = StubTalker(1, 0.005, frames)
    codec = StubCodec(1, 0.0, [(1, f) for f in make_frame_buckets(2, 25)])
    calls = []  # (frames of the call's chunk, decode steps launched when it began)
    decode = codec.decode
    codec.decode = lambda chunks: calls.append((len(chunks[0].codes), talker.steps)) or decode(chunks)

    async def main():
        engine = Engine(config)
        with mock.patch("serving.engine.loader.load_stages", lambda cfg: (talker, codec, _info(cfg, 1))):
            await engine.start()
        try:
            stream = await engine.submit(GenerationRequest(task="CustomVoice", text="stub", speaker="vivian",
                                                           max_new_tokens=frames))
            return sum([len(c) async for c in stream])
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == frames * 1920
    assert [n for n, _ in calls] == [2, 4, 8, 16, 5]
    began = dict(calls)
    # the 8-frame chunk is due at frame 14, the 16-frame one at frame 30 (a step or two of launches ahead);
    # held, both began only once the talker was past its last frame
    assert began[8] <= 14 + 4 and began[16] <= 30 + 3


def test_a_busy_reader_is_woken_once_for_the_chunks_that_came_meanwhile():
    """The engine hands each chunk to its reader's loop through that loop's Mailbox: while the loop is busy (a
    handler parsing a body), chunks of every stream pile up behind one wake-up of the loop instead of one each,
    and each stream still gets all its chunks in order."""
    async def main():
        engine = Engine(EngineConfig(model=str(resolve_model("tiny-random")), **CONFIG))
        await engine.start()
        try:
            streams = [await engine.submit(GenerationRequest(
                task="CustomVoice", text="Piled up.", speaker="vivian", max_new_tokens=8,
                sampling=SamplingParams(seed=seed))) for seed in range(4)]
            box = Mailbox.of(asyncio.get_running_loop())
            wakes = box.wakes
            deadline = time.monotonic() + 60

            def retired():  # out of the codec stage: its last chunk and its end were handed over
                return all(s.codec is not None and s not in list(engine._codec_streams) for s in streams)

            while not retired() and time.monotonic() < deadline:
                time.sleep(0.02)  # the loop is held: nothing is drained
            chunks = [[c async for c in s] for s in streams]
            return box.wakes - wakes, chunks
        finally:
            await engine.shutdown()

    wakes, chunks = asyncio.run(main())
    assert [[len(c) // 1920 for c in cs] for cs in chunks] == [[2, 4, 2]] * 4  # first chunk 2 frames, then 4
    assert wakes == 1, wakes  # one a chunk and an end each: 16


GREEDY = SamplingParams(seed=9, do_sample=False, subtalker_do_sample=False)


def assert_runner_generates_alike(runner, tts, jobs: list, frames: int) -> None:
    """Greedy, the jobs' requests decoding side by side in the runner (slot, request, the rest of generate's
    arguments each) draw the codes Qwen3TTS.generate (the model-level path the official-parity tests hold to
    qwen-tts) draws for each alone, up to its end of speech (`max_new_tokens` there: one frame fewer)."""
    got = run_frames(runner, [(slot, request) for slot, request, _ in jobs], frames)
    for slot, request, kwargs in jobs:
        want = tts.generate(request.text, language=request.language, max_new_tokens=frames + 1, do_sample=False,
                            subtalker_dosample=False, **kwargs).codes.numpy()
        assert len(want) >= 4, "degenerate test: the model ended its speech at once"
        np.testing.assert_array_equal(got[slot][:len(want)], want)


def test_the_runner_draws_the_codes_of_the_models_generate(stages):
    """Three CustomVoice requests side by side: the engine's batched, slotted step is the model's computation, in
    whatever order it runs its parts. Two stream their text in (a token a frame after the first), one ending within
    the frames and one not, so the frames' text inputs are checked too (until session 40 the engine fed token k
    with frame k, one early, the first never)."""
    runner = stages[0]
    tts = Qwen3TTS.load(str(resolve_model("tiny-random")), dtype="float32")
    frames = 16
    jobs = [(slot, GenerationRequest(task="CustomVoice", text=text, speaker=speaker, language=language,
                                     max_new_tokens=frames, non_streaming_mode=whole, sampling=GREEDY),
             dict(speaker=speaker, non_streaming_text=whole))
            for slot, text, speaker, language, whole in (
                (0, "Hello there, how are you?", "vivian", "english", True), (2, "Hi.", "ryan", "auto", False),
                (3, "A longer sentence, with more words than frames.", "dylan", "english", False))]
    streamed = [runner.prompts.build_many([r], lambda key, compute: compute())[0][0].trailing.shape[0]
                for _, r, _ in jobs]
    assert streamed[0] == 0 and 0 < streamed[1] < frames - 1 < streamed[2]  # text ending within the frames, and not
    assert_runner_generates_alike(runner, tts, jobs, frames)


def test_the_runner_clones_a_voice_as_the_models_generate_does():
    """Voice clone (text streamed in, the Base default): in-context from a reference clip and its transcript, and
    from the clip's x-vector alone, side by side (the runner encodes the clip with its own encoders, as the server
    does; generate with the model's)."""
    path = resolve_model("tiny-random-clone")
    runner, _codec, _info = load_stages(EngineConfig(model=str(path), **CONFIG))
    tts = Qwen3TTS.load(str(path), dtype="float32")
    t = np.arange(24000 * 2) / 24000
    audio = (0.3 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    frames, text = 12, "Clone this voice."
    icl = GenerationRequest(task="Base", text=text, language="english", ref_audio=audio, ref_text="A test tone.",
                            max_new_tokens=frames, sampling=GREEDY)
    xvec = GenerationRequest(task="Base", text=text, language="english", ref_audio=audio, x_vector_only=True,
                             max_new_tokens=frames, sampling=GREEDY)
    assert_runner_generates_alike(runner, tts, [
        (0, icl, dict(voice=tts.create_voice_clone_prompt(audio, 24000, ref_text="A test tone."))),
        (1, xvec, dict(voice=tts.create_voice_clone_prompt(audio, 24000, x_vector_only=True)))], frames)


def test_the_runner_designs_a_voice_as_the_models_generate_does():
    """VoiceDesign, its text whole and streamed in."""
    path = resolve_model("tiny-random-design")
    runner, _codec, _info = load_stages(EngineConfig(model=str(path), **CONFIG))
    tts = Qwen3TTS.load(str(path), dtype="float32")
    frames, instructions = 12, "A calm, low voice."
    assert_runner_generates_alike(runner, tts, [
        (slot, GenerationRequest(task="VoiceDesign", text="Design a voice now.", language="english",
                                 instructions=instructions, max_new_tokens=frames, non_streaming_mode=whole,
                                 sampling=GREEDY), dict(instruct=instructions, non_streaming_text=whole))
        for slot, whole in ((0, True), (1, False))], frames)
