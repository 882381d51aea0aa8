"""Generation on tiny checkpoints: left-padded batches equal single rows, streaming chunks equal the one-shot
decode, stopping rules, voice-clone inputs, and clear errors for requests a checkpoint cannot serve."""

import numpy as np
import pytest
import torch

from serving.model.checkpoint import write_checkpoint
from serving.model.frame import TalkerSampling, decode_frame, prefill
from serving.model.prompt import SynthesisRequest
from serving.model.sampler import SamplingParams
from serving.model.tts import Qwen3TTS, VoiceClonePrompt

GREEDY = dict(do_sample=False, subtalker_dosample=False)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cv(tmp_path_factory):
    return Qwen3TTS.load(write_checkpoint(tmp_path_factory.mktemp("cv") / "cv", "tiny", "custom_voice", seed=3),
                         dtype="float32")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return Qwen3TTS.load(write_checkpoint(tmp_path_factory.mktemp("base") / "base", "tiny", "base", seed=4),
                         dtype="float32")


def _greedy_sampling(batch: int) -> TalkerSampling:
    params = SamplingParams.build(batch, "cpu", False, 1.0, 0, 1.0)
    return TalkerSampling(code0=params, repetition_penalty=torch.full((batch,), 1.05), subtalker=params)


def test_left_padded_batch_equals_each_row_alone(cv):
    texts = ["Hi.", "A much longer sentence, so the prompts differ in length by a lot of tokens.", "Hello there!"]
    prompts = [cv.prompts.build(SynthesisRequest(text=t, task="custom_voice", speaker="serena", language="english",
                                                 non_streaming_text=(i != 1)))
               for i, t in enumerate(texts)]
    steps = 12

    def run(rows):
        state = prefill(cv.model.talker, [p.prefill for p in rows], steps + 1, _greedy_sampling(len(rows)))
        frames = []
        for step in range(steps):
            text = torch.stack([p.trailing[step] if step < p.trailing.shape[0] else p.tts_pad for p in rows])
            frames.append(decode_frame(cv.model.talker, state, text, _greedy_sampling(len(rows))))
        return torch.stack(frames, dim=1)

    batched = run(prompts)
    for i, p in enumerate(prompts):
        assert torch.equal(batched[i], run([p])[0]), f"row {i} differs when batched"


def test_frames_count_follows_max_new_tokens_and_seed_reproduces(cv):
    out = cv.generate("Hello, world.", speaker="vivian", max_new_tokens=9, **GREEDY)
    assert out.codes.shape == (8, 16) and out.audio.shape == (8 * 1920,) and out.audio.dtype == np.float32
    a = cv.generate("Hello, world.", speaker="vivian", max_new_tokens=6, seed=5)
    b = cv.generate("Hello, world.", speaker="vivian", max_new_tokens=6, seed=5)
    c = cv.generate("Hello, world.", speaker="vivian", max_new_tokens=6, seed=6)
    assert torch.equal(a.codes, b.codes) and not torch.equal(a.codes, c.codes)


def test_eos_stops_generation_but_never_before_two_frames(cv):
    talker = cv.model.talker
    bonus = torch.zeros(3072)
    bonus[2150] = 1e4  # eos wins every step once allowed
    talker.codec_logits = lambda hidden: type(talker).codec_logits(talker, hidden) + bonus
    try:
        out = cv.generate("Stop soon.", speaker="vivian", max_new_tokens=20, **GREEDY)
    finally:
        del talker.codec_logits
    assert out.codes.shape[0] == 2  # min_new_tokens 2: eos is banned for the first two code0 samples
    assert (out.codes[:, 0] < 2048).all()


def test_stream_chunks_equal_the_one_shot_decode(cv):
    kwargs = dict(speaker="dylan", language="chinese", max_new_tokens=30, **GREEDY)
    whole = cv.generate("你好，欢迎使用语音合成服务。", **kwargs)
    chunks = list(cv.stream("你好，欢迎使用语音合成服务。", first_chunk_frames=3, chunk_frames=7, **kwargs))
    assert [len(c) for c in chunks] == [n * 1920 for n in (3, 6, 7, 7, 6)]  # first, doubled, steady 7s, rest
    np.testing.assert_allclose(np.concatenate(chunks), whole.audio, atol=1e-4, rtol=0)


def test_icl_clone_stream_equals_the_one_shot_decode_after_the_reference_cut(base):
    """The reference codes prime the streaming codec, as the one-shot decode prepends them and cuts them off."""
    t = np.arange(24000 * 2) / 24000
    audio = (0.3 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    icl = base.create_voice_clone_prompt(audio, 24000, ref_text="A test tone.")
    kwargs = dict(language="english", voice=icl, max_new_tokens=12, **GREEDY)
    whole = base.generate("Clone this voice.", **kwargs)
    chunks = list(base.stream("Clone this voice.", first_chunk_frames=2, chunk_frames=5, **kwargs))
    assert [len(c) for c in chunks] == [n * 1920 for n in (2, 4, 5)]  # 2, doubled to 4, capped at 5
    np.testing.assert_allclose(np.concatenate(chunks), whole.audio, atol=1e-4, rtol=0)


def test_voice_clone_from_audio_and_from_a_supplied_embedding(base):
    t = np.arange(24000 * 2) / 24000
    audio = (0.3 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    icl = base.create_voice_clone_prompt(audio, 24000, ref_text="A test tone.")
    assert icl.ref_codes.shape == (25, 16) and icl.speaker_embedding.shape == (64,)
    out = base.generate("Clone this voice.", language="english", voice=icl, max_new_tokens=5, **GREEDY)
    assert out.codes.shape == (4, 16) and out.audio.shape == (4 * 1920,)
    xvec = base.create_voice_clone_prompt(audio, 24000, x_vector_only=True)
    assert xvec.ref_codes is None
    via_prompt = base.generate("Clone this voice.", voice=xvec, max_new_tokens=5, **GREEDY)
    via_embedding = base.generate("Clone this voice.", speaker_embedding=xvec.speaker_embedding, max_new_tokens=5,
                                  **GREEDY)
    assert torch.equal(via_prompt.codes, via_embedding.codes)
    other = base.generate("Clone this voice.", speaker_embedding=torch.randn(64), max_new_tokens=5, **GREEDY)
    assert not torch.equal(other.codes, via_prompt.codes)


@pytest.mark.parametrize("kwargs,match", [
    (dict(text="Hi", speaker="nobody"), "unsupported speaker"),
    (dict(text="Hi"), "needs a speaker"),
    (dict(text="  ", speaker="vivian"), "empty"),
    (dict(text="Hi", speaker="vivian", language="klingon"), "unsupported language"),
    (dict(text="Hi", speaker="vivian", speaker_embedding=torch.zeros(64)), "voice_clone only"),
    (dict(text="Hi", speaker="vivian", max_new_tokens=1), "max_new_tokens"),
    (dict(text="Hi", speaker="vivian", temperature=0.0), "temperature"),
])
def test_custom_voice_request_errors(cv, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cv.generate(**kwargs)


def test_clone_request_errors(base, cv):
    with pytest.raises(ValueError, match="needs a speaker embedding"):
        base.generate("Hi")
    with pytest.raises(ValueError, match=r"shape \[64\]"):
        base.generate("Hi", speaker_embedding=torch.zeros(32))
    with pytest.raises(ValueError, match="reference text"):
        base.generate("Hi", voice=VoiceClonePrompt(torch.zeros(64), ref_codes=torch.zeros(3, 16, dtype=torch.long)))
    with pytest.raises(ValueError, match="ref_text"):
        base.create_voice_clone_prompt(np.zeros(2400, np.float32), 24000)
    with pytest.raises(ValueError, match="Base checkpoint"):
        cv.create_voice_clone_prompt(np.zeros(2400, np.float32), 24000, x_vector_only=True)
    with pytest.raises(TypeError, match="unknown generation parameters"):
        base.generate("Hi", speaker_embedding=torch.zeros(64), beams=4)


def test_prompts_built_together_equal_each_built_alone(cv, base, monkeypatch):
    """A burst's prompts are tokenized in one call, copied to the device at once and their text embedded in one
    projection; each equals its prompt built alone, bit for bit (on CPU, float32), and an unservable request gets
    its error in its place without failing the others."""
    hidden = base.cfg.talker.transformer.hidden_size
    xvec = torch.randn(hidden)
    codes = torch.randint(0, 64, (5, base.cfg.talker.num_code_groups))
    for tts, reqs in (
        (cv, [SynthesisRequest(text="Hello there!", task="custom_voice", speaker="serena", language="english"),
              SynthesisRequest(text="Streamed text, token by token.", task="custom_voice", speaker="vivian",
                               language="auto", non_streaming_text=False),
              SynthesisRequest(text="Nobody.", task="custom_voice", speaker="nobody", language="english"),
              SynthesisRequest(text="Warmly, please.", task="custom_voice", speaker="eric", language="chinese",
                               instruct="Speak warmly.")]),
        (base, [SynthesisRequest(text="Cloned with a reference.", task="voice_clone", language="english",
                                 speaker_embedding=xvec, ref_codes=codes, ref_text="The reference said this."),
                SynthesisRequest(text="Only the x-vector.", task="voice_clone", language="german",
                                 speaker_embedding=xvec),
                SynthesisRequest(text="", task="voice_clone", speaker_embedding=xvec),
                SynthesisRequest(text="Non-streaming clone.", task="voice_clone", speaker_embedding=xvec,
                                 ref_codes=codes, ref_text="Reference.", non_streaming_text=True)]),
    ):
        tts.prompts.build_many(reqs)  # the shared pieces (special tokens, tags) memoised
        talker = tts.model.talker
        projections = []
        real = type(talker).embed_text
        monkeypatch.setattr(type(talker), "embed_text",
                            lambda self, ids: projections.append(ids.shape) or real(self, ids))
        together = tts.prompts.build_many(reqs)
        monkeypatch.undo()
        assert len(projections) == 1  # every text of the burst, instructions and references included
        for req, got in zip(reqs, together):
            try:
                alone = tts.prompts.build(req)
            except ValueError as exc:
                assert isinstance(got, ValueError) and str(got) == str(exc)
                continue
            assert torch.equal(got.prefill, alone.prefill) and torch.equal(got.trailing, alone.trailing)
        assert sum(isinstance(p, ValueError) for p in together) == 1


def test_prompt_pieces_are_memoised_until_the_weights_change(tmp_path):
    """The builder embeds the pieces every prompt shares once; a prompt built from the memo equals one built
    anew, and weights changed in place (a new version) clear the memo."""
    tts = Qwen3TTS.load(write_checkpoint(tmp_path / "cv", "tiny", "custom_voice", seed=5), dtype="float32")
    req = SynthesisRequest(text="Memo, memo.", task="custom_voice", speaker="serena", language="english")
    first = tts.prompts.build(req).prefill
    assert tts.prompts._memo_cache  # the shared pieces are held now
    assert torch.equal(tts.prompts.build(req).prefill, first)
    fresh = type(tts.prompts)(tts.cfg, tts.model.talker, tts.prompts.tokenizer)
    assert torch.equal(fresh.build(req).prefill, first)
    with torch.no_grad():
        tts.model.talker.model.codec_embedding.weight.mul_(2.0)
        tts.model.talker.model.text_embedding.weight.add_(0.5)
    changed = tts.prompts.build(req).prefill
    fresh = type(tts.prompts)(tts.cfg, tts.model.talker, tts.prompts.tokenizer)
    assert not torch.allclose(changed, first) and torch.equal(changed, fresh.build(req).prefill)


def test_a_tabulated_vocabulary_builds_the_projections_prompts(cv, base, monkeypatch):
    """With the text vocabulary projected once (tabulate_text, as a server on CUDA does), a burst's prompts take
    their text as rows of the table, with no projection per burst, and equal the prompts projected per burst to
    float32's last bits (a product's summation order follows its row count); weights changed in place rebuild
    the table."""
    xvec = torch.randn(base.cfg.talker.transformer.hidden_size)
    codes = torch.randint(0, 64, (5, base.cfg.talker.num_code_groups))
    for tts, reqs in (
        (cv, [SynthesisRequest(text="Hello there!", task="custom_voice", speaker="serena", language="english"),
              SynthesisRequest(text="Streamed, token by token.", task="custom_voice", speaker="vivian",
                               language="auto", non_streaming_text=False)]),
        (base, [SynthesisRequest(text="Cloned with a reference.", task="voice_clone", language="english",
                                 speaker_embedding=xvec, ref_codes=codes, ref_text="The reference said this.")]),
    ):
        plain = type(tts.prompts)(tts.cfg, tts.model.talker, tts.prompts.tokenizer)
        tabulated = type(tts.prompts)(tts.cfg, tts.model.talker, tts.prompts.tokenizer)
        tabulated.tabulate_text()
        assert tabulated.text_table_bytes == 0  # built with the first prompts
        expected = plain.build_many(reqs)
        got = tabulated.build_many(reqs)
        vocab = tts.model.talker.model.text_embedding.weight.shape[0]
        assert tabulated.text_table_bytes == vocab * tts.cfg.talker.transformer.hidden_size * 4
        close = dict(rtol=1e-5, atol=1e-6)
        for a, b in zip(got, expected):
            assert a.prefill.shape == b.prefill.shape and a.trailing.shape == b.trailing.shape
            assert torch.allclose(a.prefill, b.prefill, **close) and torch.allclose(a.trailing, b.trailing, **close)
            assert torch.allclose(a.tts_pad, b.tts_pad, **close)
        projections = []
        real = type(tts.model.talker.text_projection).forward
        monkeypatch.setattr(type(tts.model.talker.text_projection), "forward",
                            lambda self, x: projections.append(x.shape) or real(self, x))
        tabulated.build_many(reqs)
        assert projections == []
        bias = tts.model.talker.text_projection.linear_fc2.bias
        saved = bias.detach().clone()  # restored bit for bit: the module's fixtures serve the later tests
        with torch.no_grad():
            bias.add_(0.25)
        changed = tabulated.build_many(reqs)
        assert len(projections) > 0  # the table, projected again
        monkeypatch.undo()
        for a, b, before in zip(changed, plain.build_many(reqs), got):
            assert torch.allclose(a.prefill, b.prefill, **close) and not torch.allclose(a.prefill, before.prefill)
        with torch.no_grad():
            bias.copy_(saved)


def test_a_voices_prompt_pieces_are_built_once_per_voice(base, monkeypatch):
    """A voice's x-vector and reference codes reach the device, its header is built and the codes' frames are
    embedded, once per distinct voice, not per request (a burst of clones of a few voices built them in lock step with the GPU); the
    prompts equal those built without the memo, and changed weights clear it."""
    hidden, groups = base.cfg.talker.transformer.hidden_size, base.cfg.talker.num_code_groups
    voices = [(torch.randn(hidden), torch.randint(0, 64, (5 + i, groups))) for i in range(2)]
    reqs = [SynthesisRequest(text=f"Clone number {i}.", task="voice_clone", language="english",
                             speaker_embedding=voices[i % 2][0].clone(), ref_codes=voices[i % 2][1].clone(),
                             ref_text="The reference said this.") for i in range(5)]
    talker = base.model.talker
    embedded = []
    real = type(talker).embed_frame
    monkeypatch.setattr(type(talker), "embed_frame", lambda self, codes: embedded.append(codes.shape[0]) or real(self, codes))
    fresh = type(base.prompts)(base.cfg, talker, base.prompts.tokenizer)
    memo = fresh.build_many(reqs)
    assert sorted(embedded) == [5, 6]  # equal copies of a voice share its pieces
    assert sorted(key[0][0] for key in fresh._voice_memo) == ["codes", "codes", "header", "header"]
    monkeypatch.setattr("serving.model.prompt.VOICE_MEMO_SIZE", 0)
    without = type(base.prompts)(base.cfg, talker, base.prompts.tokenizer).build_many(reqs)
    assert len(embedded) == 2 + 5
    for a, b in zip(memo, without):
        assert torch.equal(a.prefill, b.prefill) and torch.equal(a.trailing, b.trailing)
    monkeypatch.setattr("serving.model.prompt.VOICE_MEMO_SIZE", 64)
    with torch.no_grad():
        talker.model.codec_embedding.weight.mul_(2.0)
    try:
        changed = fresh.build(reqs[0]).prefill
        assert len(embedded) == 2 + 5 + 1
        assert torch.equal(changed, type(base.prompts)(base.cfg, talker, base.prompts.tokenizer).build(reqs[0]).prefill)
    finally:
        with torch.no_grad():
            talker.model.codec_embedding.weight.div_(2.0)


def test_a_keyed_voice_s_prompt_pieces_are_found_by_its_key_without_hashing_its_tensors(base, monkeypatch):
    """Requests that carry their reference's key (the server's, of an uploaded voice or an inline clip) share that
    voice's pieces by it: no SHA-1 of their x-vector and codes (~60 us a request at 128 streams of clones), the
    same prompts as keyless requests build, and one entry per key and kind. The padded in-context body (a reference
    longer than the text) is the same too."""
    hidden, groups = base.cfg.talker.transformer.hidden_size, base.cfg.talker.num_code_groups
    voices = [(torch.randn(hidden), torch.randint(0, 64, (30 + i, groups))) for i in range(2)]
    def reqs(keyed: bool) -> list[SynthesisRequest]:
        return [SynthesisRequest(text=f"Clone {i}.", task="voice_clone", language="english",
                                 speaker_embedding=voices[i % 2][0].clone(), ref_codes=voices[i % 2][1].clone(),
                                 ref_text="Said.", voice_key=f"inline:{i % 2}" if keyed else None) for i in range(4)]
    keyless = type(base.prompts)(base.cfg, base.model.talker, base.prompts.tokenizer).build_many(reqs(False))
    keyed_builder = type(base.prompts)(base.cfg, base.model.talker, base.prompts.tokenizer)
    monkeypatch.setattr("serving.model.prompt.hashlib.sha1", lambda *_: pytest.fail("a keyed voice was hashed"))
    keyed = keyed_builder.build_many(reqs(True))
    memo = list(keyed_builder._voice_memo)
    assert sorted((kind[0], key) for kind, key in memo) == [("codes", "inline:0"), ("codes", "inline:1"),
                                                            ("header", "inline:0"), ("header", "inline:1")]
    for a, b in zip(keyed, keyless):
        assert a.prefill.shape[0] > 30 and torch.equal(a.prefill, b.prefill) and torch.equal(a.trailing, b.trailing)
