"""Speaker encoder, its mel front end and reference-audio reading without the reference (parity with the official
x-vector is in test_codec_parity.py)."""

import numpy as np
import pytest
import soundfile as sf
import torch
from pathlib import Path

from serving.model.mel import log_mel_spectrogram, mel_filterbank
from serving.model.resample import load_audio, read_audio, resample
from serving.model.speaker_encoder import (SpeakerEncoder, SpeakerEncoderConfig, build_speaker_encoder,
                                           init_random_, tiny_speaker_encoder_config)

VOICES = Path(__file__).resolve().parents[1] / "datasets" / "voices"


@pytest.fixture(scope="module")
def encoder():
    enc = SpeakerEncoder(tiny_speaker_encoder_config(enc_dim=32))
    init_random_(enc, torch.Generator().manual_seed(0))
    return enc.eval()


def test_config_from_checkpoint_dict():
    # 1.7B Base: enc_dim 2048; the official save_pretrained also writes "model_type": "", which must not matter
    cfg = SpeakerEncoderConfig.from_dict({"enc_dim": 2048, "sample_rate": 24000, "model_type": "",
                                          "enc_channels": [512, 512, 512, 512, 1536]})
    assert cfg.enc_dim == 2048 and cfg.enc_channels == (512, 512, 512, 512, 1536)
    assert SpeakerEncoderConfig.from_dict(cfg.to_dict()) == cfg
    assert build_speaker_encoder({"enc_dim": 64, "enc_channels": [16, 16, 16, 16, 48], "enc_attention_channels": 8,
                                  "enc_se_channels": 8}).fc.out_channels == 64


@pytest.mark.parametrize("raw, message", [
    ({"enc_channels": [512, 512, 1536]}, "same length"),
    ({"mel_dim": 80}, "fixed at 128 mels"),
    ({"sample_rate": 16000}, "24000 Hz"),
])
def test_bad_config_is_refused(raw, message):
    with pytest.raises(ValueError, match=message):
        SpeakerEncoderConfig.from_dict(raw)


def test_xvector_follows_the_voice(encoder):
    male, sr = read_audio(str(VOICES / "en_us_male.wav"))
    female, _ = read_audio(str(VOICES / "en_us_female.wav"))
    x_male, x_female = encoder.embed(male, sr), encoder.embed(female, sr)
    assert x_male.shape == (32,)
    assert torch.equal(x_male, encoder.embed(male, sr))
    assert float((x_male - x_female).abs().max()) > 1e-2
    # the same clip at another sample rate lands on (nearly) the same x-vector
    x_16k = encoder.embed(resample(male, sr, 16000), 16000)
    assert float(torch.nn.functional.cosine_similarity(x_male, x_16k, dim=0)) > 0.99


def test_equal_length_batch_equals_one_at_a_time(encoder):
    male, sr = read_audio(str(VOICES / "en_us_male.wav"))
    female, _ = read_audio(str(VOICES / "en_us_female.wav"))
    n = min(len(male), len(female))
    mels = log_mel_spectrogram(torch.from_numpy(np.stack([male[:n], female[:n]])))
    with torch.inference_mode():
        batched = encoder(mels)
        single = torch.cat([encoder(mels[:1]), encoder(mels[1:])])
    assert float((batched - single).abs().max()) < 1e-5


def test_mel_shapes_and_filterbank():
    bank = mel_filterbank()
    assert bank.shape == (128, 513) and bank.dtype == np.float32
    assert (bank >= 0).all() and (bank.sum(axis=1) > 0).all()  # every band has weight
    assert not bank[:, 512].any()  # fmax 12 kHz = Nyquist of 24 kHz: nothing above
    mels = log_mel_spectrogram(torch.zeros(2, 24000))
    assert mels.shape == (2, 24000 // 256, 128)  # 384 reflect padding each side, 1024 window, hop 256
    assert torch.isfinite(mels).all() and float(mels.min()) >= np.log(1e-5)  # silence: the floor, no -inf


def test_too_short_audio_is_refused(encoder):
    with pytest.raises(ValueError, match="reference audio too short"):
        encoder.embed(np.zeros(200, dtype=np.float32), 24000)


def test_reading_and_resampling_reference_audio(tmp_path):
    stereo = np.stack([np.linspace(-0.5, 0.5, 8000), np.zeros(8000)], axis=1).astype(np.float32)
    sf.write(tmp_path / "s.wav", stereo, 16000, subtype="FLOAT")
    audio, sr = read_audio(str(tmp_path / "s.wav"))
    assert sr == 16000 and audio.shape == (8000,)
    np.testing.assert_allclose(audio, stereo.mean(axis=1), atol=1e-7)
    assert load_audio(str(tmp_path / "s.wav"), 24000).shape == (12000,)  # ceil(8000 * 24000 / 16000)
    assert resample(np.ones(7, dtype=np.float32), 22050, 24000).shape == (8,)
    assert read_audio((tmp_path / "s.wav").read_bytes())[0].shape == (8000,)
    with pytest.raises(ValueError, match="cannot read reference audio"):
        read_audio(b"definitely not audio")
    with pytest.raises(ValueError, match="sample rates must be positive"):
        resample(audio, 0, 24000)


def test_launches_do_not_grow_with_channels(encoder):
    """Voices are encoded without cuDNN (serving/engine/prompts.py), where PyTorch's dilated convolution fills a
    bias one output channel at a time: the network must not hand it the bias (1,344 launches of 1,556 on an H100)."""
    mels = torch.randn(1, 120, 128)
    with torch.inference_mode(), torch.backends.mkldnn.flags(enabled=False), torch.profiler.profile() as prof:
        encoder(mels)
    names = [event.name for event in prof.events()]
    assert names.count("aten::slow_conv_dilated2d") == 3 * (encoder.config.enc_res2net_scale - 1)
    assert names.count("aten::copy_") < names.count("aten::conv1d")


def test_torchscript_of_the_released_sizes_gives_the_same_x_vector_and_codes():
    """The server scripts both reference encoders (serving.engine.prompts.as_torchscript); at the released sizes, on real
    speech, the scripted networks agree with the modules to the bit."""
    from serving.engine.prompts import as_torchscript
    from serving.model.checkpoint import model_config_dict
    from serving.model.codec_config import released_codec_config
    from serving.model.speech_tokenizer import SpeechTokenizer
    from serving.model.speech_tokenizer import init_random_ as init_codec_random_

    speaker = build_speaker_encoder(model_config_dict("0.6B", "base")["speaker_encoder_config"])
    init_random_(speaker, torch.Generator().manual_seed(1))
    codec = SpeechTokenizer(released_codec_config())
    init_codec_random_(codec, seed=2)
    speaker, codec = speaker.eval(), codec.encoder.float().eval()
    audio, sr = read_audio(str(VOICES / "fr_female.wav"))
    with torch.jit.optimized_execution(False):
        assert torch.equal(speaker.embed(audio, sr, net=as_torchscript(speaker)), speaker.embed(audio, sr))
        assert torch.equal(codec.encode([audio], sr, net=as_torchscript(codec))[0], codec.encode([audio], sr)[0])
