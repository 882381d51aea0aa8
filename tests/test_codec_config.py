"""speech_tokenizer/config.json: the released layout parses, round-trips, and bad files say what is wrong."""

import json

import pytest

from serving.model.codec_config import CodecConfig, released_codec_config, tiny_codec_config

# speech_tokenizer/config.json as shipped with the Qwen3-TTS-12Hz checkpoints (keys the loader does not use,
# like semantic_codebook_size, are there too and must be ignored).
RELEASED = {
    "architectures": ["Qwen3TTSTokenizerV2Model"],
    "model_type": "qwen3_tts_tokenizer_12hz",
    "encoder_valid_num_quantizers": 16,
    "input_sample_rate": 24000,
    "output_sample_rate": 24000,
    "decode_upsample_rate": 1920,
    "encode_downsample_rate": 1920,
    "encoder_config": {
        "_frame_rate": 12.5, "audio_channels": 1, "num_filters": 64, "kernel_size": 7, "residual_kernel_size": 3,
        "last_kernel_size": 3, "num_residual_layers": 1, "compress": 2, "upsampling_ratios": [8, 6, 5, 4],
        "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
        "head_dim": 64, "intermediate_size": 2048, "hidden_act": "gelu", "norm_eps": 1e-5,
        "layer_scale_initial_scale": 0.01, "rope_theta": 10000, "max_position_embeddings": 8000,
        "sliding_window": 250, "num_quantizers": 32, "num_semantic_quantizers": 1, "codebook_size": 2048,
        "codebook_dim": 256, "vector_quantization_hidden_dimension": 256, "pad_mode": "constant",
        "use_causal_conv": True, "model_type": "mimi",
    },
    "decoder_config": {
        "latent_dim": 1024, "codebook_dim": 512, "codebook_size": 2048, "decoder_dim": 1536, "hidden_size": 512,
        "intermediate_size": 1024, "hidden_act": "silu", "num_hidden_layers": 8, "num_attention_heads": 16,
        "num_key_value_heads": 16, "head_dim": 64, "rms_norm_eps": 1e-5, "layer_scale_initial_scale": 0.01,
        "rope_theta": 10000, "max_position_embeddings": 8000, "sliding_window": 72, "num_quantizers": 16,
        "num_semantic_quantizers": 1, "semantic_codebook_size": 4096, "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2], "vector_quantization_hidden_dimension": 512, "attention_bias": False,
    },
}


def _write(tmp_path, raw):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def test_released_file_parses_to_the_released_config(tmp_path):
    cfg = CodecConfig.from_dir(_write(tmp_path, RELEASED))
    assert cfg == released_codec_config()
    assert cfg.decoder.total_upsample == 1920
    assert cfg.decoder.head_dim == 64 and cfg.decoder.hidden_size == 512
    assert cfg.encoder.frame_rate == 12.5 and cfg.encoder.encodec_frame_rate == 25
    assert cfg.encoder.has_downsample and cfg.encoder.downsample_stride == 4
    assert cfg.num_quantizers == 16 and cfg.encoder.num_quantizers == 32


@pytest.mark.parametrize("make", [released_codec_config, tiny_codec_config])
def test_to_dict_round_trips(make):
    cfg = make()
    assert CodecConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_head_dim_falls_back_to_hidden_over_heads():
    raw = json.loads(json.dumps(RELEASED))
    del raw["decoder_config"]["head_dim"]
    assert CodecConfig.from_dict(raw).decoder.head_dim == 512 // 16


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r.update(model_type="qwen3_tts_tokenizer_25hz"), "only 'qwen3_tts_tokenizer_12hz'"),
    (lambda r: r.update(decode_upsample_rate=2400), "decode_upsample_rate 2400"),
    (lambda r: r["decoder_config"].update(upsample_rates=8), "decoder_config.upsample_rates: expected a list"),
    (lambda r: r.update(encoder_valid_num_quantizers=8), "encoder_valid_num_quantizers 8"),
    (lambda r: r["encoder_config"].update(pad_mode="reflect"), "pad_mode"),
])
def test_bad_config_names_the_problem(tmp_path, mutate, message):
    raw = json.loads(json.dumps(RELEASED))
    mutate(raw)
    with pytest.raises(ValueError, match=message) as info:
        CodecConfig.from_dir(_write(tmp_path, raw))
    assert str(tmp_path / "config.json") in str(info.value)


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="speech tokenizer config not found"):
        CodecConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        CodecConfig.from_dir(tmp_path)
