"""Loading and validating text sets and task inputs, and the request bodies built from them."""

from __future__ import annotations

import base64
import io
import json
import wave
from pathlib import Path

import numpy as np
import pytest
import soundfile

from ttsbench import datasets
from ttsbench.requests import FRESH_BITS, RequestBuilder, RequestOptions

REPO_DATASETS = Path(__file__).resolve().parent.parent / "datasets"


def _write(path: Path, lines: list) -> Path:
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l, ensure_ascii=False)) + "\n" for l in lines),
                    encoding="utf-8")
    return path


@pytest.mark.parametrize("line,message", [
    ('{"id": "a", "text": "hi", "language": "English"', "not valid JSON"),
    ('["a", "b"]', "expected a JSON object"),
    ('{"id": "a", "language": "English"}', "field 'text'"),
    ('{"id": "a", "text": "  ", "language": "English"}', "field 'text'"),
    ('{"id": "a", "text": "hi", "language": "Klingon"}', "unknown language 'Klingon'"),
    ('{"id": "first", "text": "hi"}', "duplicate id 'first'"),
    ('{"id": ["x"], "text": "hi"}', "field 'id'"),
])
def test_user_dataset_errors_name_file_and_line(tmp_path, line, message):
    path = _write(tmp_path / "mine.jsonl", [{"id": "first", "text": "ok", "language": "English"}, "", line])
    with pytest.raises(datasets.DatasetError) as e:
        datasets.load_items(path, strict=False)
    assert str(e.value).startswith(f"{path}:3: ") and message in str(e.value)


def test_user_dataset_defaults_and_language_spelling(tmp_path):
    path = _write(tmp_path / "mine.jsonl", [{"text": "hello"}, {"id": 7, "text": "hallo", "language": "german"}])
    items = datasets.load_items(path, strict=False)
    assert items == [datasets.Item("mine-1", "hello", "Auto"), datasets.Item("7", "hallo", "German")]


def test_builtin_sets_require_id_and_language(tmp_path):
    path = _write(tmp_path / "short.jsonl", [{"id": "a", "text": "hi"}])
    with pytest.raises(datasets.DatasetError, match=r"short.jsonl:1: field 'language' is missing"):
        datasets.load_items(path)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(datasets.DatasetError, match="no such file"):
        datasets.load_items(tmp_path / "nope.jsonl")
    with pytest.raises(datasets.DatasetError, match="no items"):
        datasets.load_items(_write(tmp_path / "empty.jsonl", [""]))


def test_datasets_dir_override(tmp_path, monkeypatch):
    monkeypatch.setenv("TTSBENCH_DATASETS", str(tmp_path))
    assert datasets.datasets_dir() == tmp_path
    with pytest.raises(datasets.DatasetError, match="short.jsonl: no such file"):
        datasets.load_set("short")


@pytest.mark.skipif(not (REPO_DATASETS / "short.jsonl").exists(), reason="built-in data not written yet")
def test_builtin_sets_load_and_meet_their_counts(monkeypatch):
    monkeypatch.delenv("TTSBENCH_DATASETS", raising=False)
    assert datasets.datasets_dir() == REPO_DATASETS
    sets = {name: datasets.load_set(name) for name in datasets.BUILTIN_SETS}
    assert len(sets["short"]) >= 64 and all(len(i.text) < 50 for i in sets["short"])
    assert len(sets["medium"]) >= 64 and all(50 <= len(i.text) <= 200 for i in sets["medium"])
    assert len(sets["long"]) >= 32 and all(len(i.text) > 200 for i in sets["long"])
    per_language = {}
    for item in sets["multilingual"]:
        per_language[item.language] = per_language.get(item.language, 0) + 1
    assert set(per_language) >= set(datasets.LANGUAGES) - {"Auto"}
    assert min(per_language.values()) >= 8
    assert {i.group for i in sets["multilingual"]} >= {"zh", "en", "zh-en"}
    assert [s.name for s in datasets.load_speakers()] == [
        "vivian", "serena", "uncle_fu", "dylan", "eric", "ryan", "aiden", "ono_anna", "sohee"]
    assert datasets.load_instructions() and datasets.load_designs()
    voices = datasets.load_voices()
    assert voices and all(v.path.is_file() and v.ref_text for v in voices)


@pytest.fixture
def fixture_data(tmp_path, monkeypatch):
    """A complete small datasets folder, so builders do not depend on the built-in files."""
    _write(tmp_path / "speakers.jsonl", [{"name": "vivian", "language": "Chinese", "description": "d"},
                                         {"name": "ryan", "language": "English", "description": "d"}])
    _write(tmp_path / "instructions.jsonl", [{"id": "i1", "text": "Whisper."}, {"id": "i2", "text": "Shout."}])
    _write(tmp_path / "designs.jsonl", [{"id": "d1", "text": "A calm old man.", "language": "English"}])
    (tmp_path / "voices").mkdir()
    soundfile.write(tmp_path / "voices" / "v1.wav", np.zeros(2400, dtype=np.int16), 24000, subtype="PCM_16")
    _write(tmp_path / "voices" / "voices.jsonl", [{"name": "v1", "file": "v1.wav", "ref_text": "Hello there.",
                                                   "language": "English", "command": "made in a test"}])
    monkeypatch.setenv("TTSBENCH_DATASETS", str(tmp_path))
    return tmp_path


ITEM = datasets.Item("x1", "Good morning.", "English")


def _body(task, index=0, **options):
    return json.loads(RequestBuilder(task, RequestOptions(**options)).build(ITEM, index).body)


def test_custom_bodies_round_robin_speakers_and_instructions(fixture_data):
    bodies = [_body("custom", i, instructions="on", model="m") for i in range(3)]
    assert [b["voice"] for b in bodies] == ["vivian", "ryan", "vivian"]
    assert [b["instructions"] for b in bodies] == ["Whisper.", "Shout.", "Whisper."]
    assert bodies[0] == {"input": "Good morning.", "model": "m", "task_type": "CustomVoice", "voice": "vivian",
                         "language": "English", "instructions": "Whisper.", "response_format": "pcm",
                         "stream": True, "stream_format": "audio"}
    assert "instructions" not in _body("custom")
    assert _body("custom", instructions="Sound sleepy.")["instructions"] == "Sound sleepy."
    assert _body("custom", 1, voice="Dylan")["voice"] == "Dylan"


def test_design_and_clone_bodies(fixture_data):
    design = _body("design", stream=False, max_new_tokens=512, sampling_seed=3, language="Auto")
    assert design["task_type"] == "VoiceDesign" and design["instructions"] == "A calm old man."
    assert design["response_format"] == "wav" and design["stream"] is False and "stream_format" not in design
    assert design["max_new_tokens"] == 512 and design["seed"] == 3 and design["language"] == "Auto"
    clone = _body("clone", stream_format="sse")
    assert clone["task_type"] == "Base" and clone["ref_text"] == "Hello there." and clone["stream_format"] == "sse"
    prefix = "data:audio/wav;base64,"
    assert clone["ref_audio"].startswith(prefix)
    assert base64.b64decode(clone["ref_audio"][len(prefix):]) == (fixture_data / "voices" / "v1.wav").read_bytes()
    built = RequestBuilder("clone", RequestOptions()).build(ITEM, 0)
    assert built.voice == "v1" and built.ref_audio_path == "voices/v1.wav"
    uploaded = _body("clone", clone_mode="upload")
    assert uploaded["voice"] == "v1" and "ref_audio" not in uploaded


@pytest.mark.parametrize("mode", ["inline", "fresh"])
def test_a_clone_body_is_one_json_object_with_its_clip_joined_as_it_is(fixture_data, mode):
    """The clip joins the serialised body without json.dumps: the body is still one JSON object, its text as
    written (not escaped to ASCII), every field once, whatever the text holds."""
    item = datasets.Item("z1", 'Ni hao "ref_audio": 你好, {}', "Chinese")
    body = RequestBuilder("clone", RequestOptions(clone_mode=mode, max_new_tokens=7)).build(item, 0).body
    parsed = json.loads(body)
    assert parsed["input"] == item.text and "你好".encode() in body
    assert {k for k in parsed} == {"input", "task_type", "language", "ref_text", "ref_audio", "response_format",
                                   "stream", "stream_format", "max_new_tokens"}
    assert parsed["ref_audio"].startswith("data:audio/wav;base64,") and body.count(b'"ref_audio": "data:') == 1
    clip = base64.b64decode(parsed["ref_audio"].split(",", 1)[1])
    assert len(clip) == len((fixture_data / "voices" / "v1.wav").read_bytes())


def test_fresh_clone_clips_are_new_voices_that_sound_the_same(fixture_data):
    """--clone-mode fresh: every request's clip differs from every other's, this run's and another's, in the
    lowest bit of its first samples only."""
    prefix = "data:audio/wav;base64,"

    def samples(body):
        with wave.open(io.BytesIO(base64.b64decode(body["ref_audio"][len(prefix):]))) as w:
            assert (w.getframerate(), w.getsampwidth(), w.getnchannels()) == (24000, 2, 1)
            return np.frombuffer(w.readframes(w.getnframes()), "<i2")

    original, _ = soundfile.read(fixture_data / "voices" / "v1.wav", dtype="int16")
    builder = RequestBuilder("clone", RequestOptions(clone_mode="fresh"))
    clips = [samples(json.loads(builder.build(ITEM, i).body)) for i in range(3)]
    clips.append(samples(_body("clone", clone_mode="fresh")))  # another run's builder
    assert len({c.tobytes() for c in clips}) == 4
    for clip in clips:
        assert clip.shape == original.shape and np.abs(clip.astype(int) - original).max() <= 1
        assert (clip[FRESH_BITS:] == original[FRESH_BITS:]).all()
    body = json.loads(builder.build(ITEM, 0).body)
    assert body["ref_text"] == "Hello there." and body["task_type"] == "Base"


def test_clone_unknown_voice(fixture_data):
    with pytest.raises(datasets.DatasetError, match="unknown reference voice 'nobody'; available: v1"):
        RequestBuilder("clone", RequestOptions(voice="nobody"))
