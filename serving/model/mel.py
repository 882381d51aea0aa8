"""The log-mel front end of the speaker encoder, equal to the official `mel_spectrogram` call in
Qwen3TTSForConditionalGeneration.extract_speaker_embedding: 24 kHz, n_fft = win = 1024, hop 256, 128 Slaney mels
over 0-12 kHz (librosa.filters.mel defaults), reflect padding of 384 on each side, no centering, magnitude
sqrt(re^2 + im^2 + 1e-9), natural log after clamping at 1e-5.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from serving.model.config import SAMPLE_RATE

N_FFT = 1024
HOP = 256
N_MELS = 128
FMIN = 0.0
FMAX = 12000.0


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney mel scale: linear below 1 kHz, logarithmic above (librosa htk=False)."""
    hz = np.asarray(hz, dtype=np.float64)
    f_sp = 200.0 / 3
    mel = hz / f_sp
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, np.log(6.4) / 27.0
    above = hz >= min_log_hz
    mel[above] = min_log_mel + np.log(hz[above] / min_log_hz) / logstep
    return mel


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    f_sp = 200.0 / 3
    hz = f_sp * mel
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, np.log(6.4) / 27.0
    above = mel >= min_log_mel
    hz[above] = min_log_hz * np.exp(logstep * (mel[above] - min_log_mel))
    return hz


@functools.lru_cache(maxsize=4)
def mel_filterbank(sample_rate: int = SAMPLE_RATE, n_fft: int = N_FFT, n_mels: int = N_MELS,
                   fmin: float = FMIN, fmax: float = FMAX) -> np.ndarray:
    """(n_mels, n_fft // 2 + 1) float32 triangular filters with Slaney area normalisation, as
    librosa.filters.mel(sr, n_fft, n_mels, fmin, fmax) computes them (float32 accumulation included)."""
    fft_freqs = np.fft.rfftfreq(n=n_fft, d=1.0 / sample_rate)
    mel_freqs = _mel_to_hz(np.linspace(_hz_to_mel(np.array([fmin]))[0], _hz_to_mel(np.array([fmax]))[0], n_mels + 2))
    fdiff = np.diff(mel_freqs)
    ramps = np.subtract.outer(mel_freqs, fft_freqs)
    weights = np.zeros((n_mels, 1 + n_fft // 2), dtype=np.float32)
    for i in range(n_mels):
        lower = -ramps[i] / fdiff[i]
        upper = ramps[i + 2] / fdiff[i + 1]
        weights[i] = np.maximum(0, np.minimum(lower, upper))
    weights *= (2.0 / (mel_freqs[2: n_mels + 2] - mel_freqs[:n_mels]))[:, None]
    return weights


def log_mel_spectrogram(wav_bl: torch.Tensor) -> torch.Tensor:
    """(B, samples) 24 kHz waveform -> (B, samples // 256, 128) log mel."""
    if wav_bl.dim() != 2:
        raise ValueError(f"waveform must be (batch, samples), got shape {tuple(wav_bl.shape)}")
    pad = (N_FFT - HOP) // 2
    if wav_bl.shape[1] <= pad:
        raise ValueError(f"reference audio too short for the speaker encoder: {wav_bl.shape[1]} samples "
                         f"(need more than {pad}, i.e. {pad / SAMPLE_RATE * 1000:.0f} ms at 24 kHz)")
    wav_bl = wav_bl.float()
    padded = F.pad(wav_bl.unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)
    window = torch.hann_window(N_FFT, device=wav_bl.device)
    spec = torch.stft(padded, N_FFT, hop_length=HOP, win_length=N_FFT, window=window, center=False,
                      normalized=False, onesided=True, return_complex=True)
    magnitude = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    mel_basis = torch.from_numpy(mel_filterbank()).to(wav_bl.device)
    mel = torch.matmul(mel_basis, magnitude)
    return torch.log(torch.clamp(mel, min=1e-5)).transpose(1, 2)
