"""Reference side of the codec and speaker-encoder parity tests: runs in .venv-ref (official qwen-tts 0.1.1).

    .venv-ref/bin/python tests/codec_reference.py JOBS_JSON

JOBS_JSON is a list of [mode, *args] run in one process (importing transformers once costs ~20 s here):
    ["keys", CONFIG_JSON, SPEAKER_CONFIG_JSON, OUT_JSON]
    ["decode", SPEECH_TOKENIZER_DIR, CODES_NPY, OUT_NPZ, DTYPE?]  (DTYPE: float32 default, bfloat16)
    ["encode", SPEECH_TOKENIZER_DIR, AUDIO_FILE, OUT_NPZ]
    ["xvector", SPEAKER_CONFIG_JSON, WEIGHTS, AUDIO_FILE, OUT_NPZ]
    ["mel_filterbank", OUT_NPY]
Each mode calls the official code the way qwen_tts.Qwen3TTSModel does; the main venv compares the results.
It imports nothing from this repository.
"""

import json
import sys

import numpy as np
import torch


def _tokenizer_classes():
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model
    return Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model


def _speaker_encoder(config_path):
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSSpeakerEncoderConfig
    from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSSpeakerEncoder
    with open(config_path) as f:
        return Qwen3TTSSpeakerEncoder(Qwen3TTSSpeakerEncoderConfig(**json.load(f)))


def keys(config_json, speaker_config_json, out_json):
    """Parameter and buffer names and shapes of the official modules built from these configs."""
    config_cls, model_cls = _tokenizer_classes()
    with open(config_json) as f:
        model = model_cls(config_cls(**json.load(f)))
    shapes = {name: list(t.shape) for name, t in model.state_dict().items()}
    shapes.update({f"speaker_encoder.{name}": list(t.shape)
                   for name, t in _speaker_encoder(speaker_config_json).state_dict().items()})
    with open(out_json, "w") as f:
        json.dump(shapes, f)


def _load_tokenizer(directory, dtype="float32"):
    """As Qwen3TTSModel.from_pretrained(..., dtype=...) loads its speech tokenizer: with the model's dtype."""
    from qwen_tts.inference.qwen3_tts_tokenizer import Qwen3TTSTokenizer
    return Qwen3TTSTokenizer.from_pretrained(directory, dtype=getattr(torch, dtype))


def decode(directory, codes_npy, out_npz, dtype="float32"):
    """codes (B, T, 16) with -1 right padding -> one waveform per row (Qwen3TTSTokenizer.decode)."""
    tokenizer = _load_tokenizer(directory, dtype)
    codes = np.load(codes_npy)
    rows = [row[: int((row[:, 0] > -1).sum())] for row in codes]
    wavs, sr = tokenizer.decode([{"audio_codes": torch.from_numpy(r)} for r in rows])
    np.savez(out_npz, sr=sr, **{f"wav{i}": w for i, w in enumerate(wavs)})


def encode(directory, audio_file, out_npz):
    """Audio file at any sample rate -> (T, 16) codes, as create_voice_clone_prompt encodes ref_audio."""
    tokenizer = _load_tokenizer(directory)
    codes = tokenizer.encode(audio_file).audio_codes[0]
    np.savez(out_npz, codes=codes.numpy(), attn=type(tokenizer.model.encoder.encoder_transformer.layers[0]
                                                     .self_attn).__name__)


def xvector(speaker_config_json, weights, audio_file, out_npz):
    """Audio file -> x-vector, the steps of create_voice_clone_prompt + extract_speaker_embedding."""
    import librosa
    from qwen_tts.core.models.modeling_qwen3_tts import mel_spectrogram
    from safetensors.torch import load_file

    encoder = _speaker_encoder(speaker_config_json)
    state = {k[len("speaker_encoder."):]: v for k, v in load_file(weights).items() if k.startswith("speaker_encoder.")}
    encoder.load_state_dict(state, strict=True)
    encoder.eval()
    audio, sr = librosa.load(audio_file, sr=None, mono=True)
    if sr != 24000:
        audio = librosa.resample(y=audio.astype(np.float32), orig_sr=int(sr), target_sr=24000)
    with torch.inference_mode():
        mels = mel_spectrogram(torch.from_numpy(audio).unsqueeze(0), n_fft=1024, num_mels=128, sampling_rate=24000,
                               hop_size=256, win_size=1024, fmin=0, fmax=12000).transpose(1, 2)
        xvec = encoder(mels)[0]
    np.savez(out_npz, xvector=xvec.numpy(), mels=mels[0].numpy(), audio=audio)


def mel_filterbank(out_npy):
    """The filterbank the official mel_spectrogram builds."""
    from librosa.filters import mel
    np.save(out_npy, mel(sr=24000, n_fft=1024, n_mels=128, fmin=0, fmax=12000))


MODES = {"keys": keys, "decode": decode, "encode": encode, "xvector": xvector, "mel_filterbank": mel_filterbank}

if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    for mode, *args in jobs:
        MODES[mode](*args)
