"""Request validation: every field's bad values give a 400 (or 404 for the model) that names the field."""

import pytest

from serving.api.errors import APIError
from serving.api.protocol import Capabilities, parse_speech_request
from serving.model.config import GenerationDefaults

CUSTOM = Capabilities(model_names=("tiny", "/ckpt/tiny"), task_type="CustomVoice", speakers=("vivian", "ryan"),
                      languages=("auto", "english", "chinese"), supports_instructions=True)
CUSTOM_06B = Capabilities(model_names=("tiny",), task_type="CustomVoice", speakers=("vivian",),
                          languages=("auto", "english"), supports_instructions=False)
DESIGN = Capabilities(model_names=("tiny",), task_type="VoiceDesign", languages=("auto", "english"))
BASE = Capabilities(model_names=("tiny",), task_type="Base", languages=("auto", "english"), speaker_embedding_dim=4)


def parse(body, caps=CUSTOM):
    return parse_speech_request(body, caps)


def error(body, caps=CUSTOM) -> APIError:
    with pytest.raises(APIError) as info:
        parse(body, caps)
    return info.value


def test_defaults_follow_the_checkpoint_and_vllm_omni():
    req = parse({"input": "Hello"})
    assert req.voice == "vivian" and req.language == "auto" and req.response_format == "wav"
    assert req.stream is False and req.max_new_tokens == 2048 and req.task_type == "CustomVoice"
    assert (req.temperature, req.top_k, req.top_p, req.repetition_penalty) == (0.9, 50, 1.0, 1.05)


def test_all_fields_are_read():
    req = parse({"input": "Hi", "model": "/ckpt/tiny", "speaker": "RYAN", "instructions": "calm",
                 "task_type": "customvoice", "language": "English", "response_format": "PCM", "speed": 1.5,
                 "stream": True, "stream_format": "sse", "max_new_tokens": 7, "seed": 3,
                 "initial_codec_chunk_frames": 2, "temperature": 0.5, "top_k": 0, "top_p": 0.8,
                 "repetition_penalty": 1.2, "do_sample": False, "non_streaming_mode": True,
                 "subtalker_temperature": 0.7, "subtalker_top_k": 10, "subtalker_top_p": 0.9})
    assert req.voice == "ryan" and req.language == "english" and req.response_format == "pcm"
    assert req.stream and req.stream_format == "sse" and req.seed == 3 and req.initial_codec_chunk_frames == 2
    assert (req.temperature, req.top_k, req.top_p, req.repetition_penalty, req.do_sample) == (0.5, 0, 0.8, 1.2, False)
    assert (req.subtalker_temperature, req.subtalker_top_k, req.subtalker_top_p) == (0.7, 10, 0.9)
    assert req.non_streaming_mode is True and req.speed == 1.5


@pytest.mark.parametrize("body,param", [
    ({}, "input"),
    ({"input": "   "}, "input"),
    ({"input": "x" * 4097}, "input"),
    ({"input": 5}, "input"),
    ({"input": "a", "voice": "alloy"}, "voice"),
    ({"input": "a", "voice": "vivian", "speaker": "ryan"}, "voice"),
    ({"input": "a", "language": "klingon"}, "language"),
    ({"input": "a", "task_type": "Base"}, "task_type"),
    ({"input": "a", "task_type": "Other"}, "task_type"),
    ({"input": "a", "response_format": "aac"}, "response_format"),
    ({"input": "a", "stream": True, "response_format": "mp3"}, "response_format"),
    ({"input": "a", "stream": "yes"}, "stream"),
    ({"input": "a", "stream_format": "ws"}, "stream_format"),
    ({"input": "a", "speed": 0.1}, "speed"),
    ({"input": "a", "speed": 4.5}, "speed"),
    ({"input": "a", "speed": True}, "speed"),
    ({"input": "a", "max_new_tokens": 0}, "max_new_tokens"),
    ({"input": "a", "max_new_tokens": 5000}, "max_new_tokens"),
    ({"input": "a", "max_new_tokens": 2.5}, "max_new_tokens"),
    ({"input": "a", "seed": -1}, "seed"),
    ({"input": "a", "initial_codec_chunk_frames": 0}, "initial_codec_chunk_frames"),
    ({"input": "a", "initial_codec_chunk_frames": 26}, "initial_codec_chunk_frames"),
    ({"input": "a", "temperature": 0}, "temperature"),
    ({"input": "a", "top_k": -1}, "top_k"),
    ({"input": "a", "top_p": 0}, "top_p"),
    ({"input": "a", "top_p": 1.5}, "top_p"),
    ({"input": "a", "repetition_penalty": 0}, "repetition_penalty"),
    ({"input": "a", "do_sample": 1}, "do_sample"),
    ({"input": "a", "subtalker_temperature": -1}, "subtalker_temperature"),
    ({"input": "a", "subtalker_top_k": "5"}, "subtalker_top_k"),
    ({"input": "a", "subtalker_top_p": 2}, "subtalker_top_p"),
    ({"input": "a", "instructions": "x" * 501}, "instructions"),
    ({"input": "a", "ref_audio": "data:audio/wav;base64,AAAA"}, "ref_audio"),
    ({"input": "a", "speaker_embedding": [1, 2, 3, 4]}, "speaker_embedding"),
])
def test_invalid_fields_are_400_naming_the_field(body, param):
    err = error(body)
    assert err.status == 400 and err.param == param and err.message


def test_unknown_model_is_404():
    err = error({"input": "a", "model": "gpt-4o-mini-tts"})
    assert err.status == 404 and err.code == "model_not_found"


def test_body_must_be_an_object():
    assert error(["input"]).status == 400


def test_instructions_on_a_0_6b_custom_voice_checkpoint_are_refused():
    assert error({"input": "a", "instructions": "happy"}, CUSTOM_06B).param == "instructions"
    assert parse({"input": "a", "instructions": "  "}, CUSTOM_06B).instructions is None


def test_voice_design_needs_instructions_and_ignores_the_voice_name():
    assert error({"input": "a"}, DESIGN).param == "instructions"
    req = parse({"input": "a", "voice": "alloy", "instructions": "a deep voice"}, DESIGN)
    assert req.voice is None and req.task_type == "VoiceDesign"
    assert error({"input": "a", "instructions": "x", "ref_audio": "data:,"}, DESIGN).status == 400


def test_base_needs_a_reference():
    assert error({"input": "a"}, BASE).param == "ref_audio"
    assert error({"input": "a", "ref_audio": "v", "instructions": "calm"}, BASE).param == "instructions"
    assert error({"input": "a", "ref_audio": "v", "speaker_embedding": [0, 0, 0, 0]}, BASE).param == "speaker_embedding"
    assert error({"input": "a", "speaker_embedding": [0, 0, 0]}, BASE).param == "speaker_embedding"
    assert error({"input": "a", "speaker_embedding": [0, 0, 0, float("inf")]}, BASE).param == "speaker_embedding"
    req = parse({"input": "a", "speaker_embedding": [0, 1, 2, 3]}, BASE)
    assert req.x_vector_only_mode and req.speaker_embedding == [0.0, 1.0, 2.0, 3.0]
    assert parse({"input": "a", "voice": "MyVoice"}, BASE).voice == "myvoice"


def test_sampling_defaults_are_the_served_checkpoints_generation_config():
    own = GenerationDefaults(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.1, do_sample=False,
                             subtalker_temperature=0.5, subtalker_top_k=10, subtalker_top_p=0.9,
                             subtalker_dosample=False)
    caps = Capabilities(model_names=("tiny",), task_type="CustomVoice", speakers=("vivian",), generation=own)
    req = parse({"input": "Hello"}, caps)
    assert (req.temperature, req.top_k, req.top_p, req.repetition_penalty, req.do_sample) == (0.7, 20, 0.8, 1.1, False)
    assert (req.subtalker_temperature, req.subtalker_top_k, req.subtalker_top_p, req.subtalker_do_sample) == (
        0.5, 10, 0.9, False)
    explicit = parse({"input": "Hello", "temperature": 1.2, "subtalker_do_sample": True}, caps)
    assert explicit.temperature == 1.2 and explicit.subtalker_do_sample is True and explicit.top_k == 20
