"""Where a new reference voice's encoding goes: the speaker encoder (x-vector) and the codec encoder (reference
codes) over each clip of datasets/voices, as the server runs them for a voice clone it has not met.

    python benchmarks/voice_encode_bench.py [--device cuda] [--size 0.6B] [--reps 3] [--profile] [--json OUT.json]

Served on an H100, a clone level's first requests waited 70-120 ms each on their new voice (phase prefill at c=1,
docs/performance.md), more than the ~40 ms an earlier measurement of one clip gave. This times, per clip, the
speaker encoder's parts (resampling on the host, the log-mel front end, the network) and the codec encoder's
encode, each synchronised, on a clip's first call (a length the process has not met: what a new voice costs) and
the median of --reps repeats; with cuDNN off, as serving.engine.prompts runs them. --profile counts the kernels
of one repeat of each encoder and their summed GPU time, against its wall time: far apart, the encoder is bound by
its launches, not the GPU. Random weights of the released architectures (the sizes' speaker encoder configs and the
released 12 Hz speech tokenizer; `--size tiny`: the tests' small ones), built in memory: no checkpoint needed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from serving.model import mel as mel_frontend
from serving.model.checkpoint import model_config_dict
from serving.model.codec_config import released_codec_config, tiny_codec_config
from serving.model.config import SAMPLE_RATE
from serving.model.resample import resample, to_mono
from serving.model.speaker_encoder import build_speaker_encoder
from serving.model.speaker_encoder import init_random_ as init_speaker_random_
from serving.model.speech_tokenizer import SpeechTokenizer
from serving.model.speech_tokenizer import init_random_ as init_codec_random_

VOICES = Path(__file__).resolve().parents[1] / "datasets" / "voices"


def build(size: str, device: torch.device):
    """(speaker encoder, codec encoder) with random weights, float32 on `device`, as the loader places them."""
    speaker = build_speaker_encoder(model_config_dict(size, "base")["speaker_encoder_config"])
    init_speaker_random_(speaker, torch.Generator().manual_seed(1))
    codec = SpeechTokenizer(tiny_codec_config() if size == "tiny" else released_codec_config())
    init_codec_random_(codec, seed=2)
    return speaker.float().to(device).eval(), codec.encoder.float().to(device).eval()


def timed(fn, device: torch.device) -> tuple[object, float]:
    """(result, ms) of fn with the device synchronised before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) * 1e3


def encode_parts(speaker, codec, audio: np.ndarray, device: torch.device) -> dict[str, float]:
    """ms of each part of one voice's encoding (SpeakerEncoder.embed's steps, then CodecEncoder.encode)."""
    wav, resample_ms = timed(lambda: resample(audio, SAMPLE_RATE, speaker.config.sample_rate), device)
    mels, mel_ms = timed(lambda: mel_frontend.log_mel_spectrogram(torch.from_numpy(wav).unsqueeze(0).to(device)),
                         device)
    _, net_ms = timed(lambda: speaker(mels), device)
    _, codec_ms = timed(lambda: codec.encode([audio], SAMPLE_RATE), device)
    return {"resample": resample_ms, "mel": mel_ms, "speaker_net": net_ms, "codec": codec_ms,
            "total": resample_ms + mel_ms + net_ms + codec_ms}


def kernel_profile(fn, device: torch.device) -> dict:
    """Kernels launched by one call of fn, their summed device time and the call's wall time (ms), and the
    operators that launch the most kernels (count, and the kernels' names): where a launch-bound call's time goes."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        _, wall = timed(fn, device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, int] = {}
    for k in kernels:
        by_name[k.name[:90]] = by_name.get(k.name[:90], 0) + 1
    ops = sorted(((e.key, e.count) for e in prof.key_averages() if e.key.startswith("aten::")),
                 key=lambda kv: -kv[1])
    return {"kernels": len(kernels), "kernel_ms": round(sum(e.device_time for e in kernels) / 1e3, 2),
            "wall_ms": round(wall, 2), "top_kernels": sorted(by_name.items(), key=lambda kv: -kv[1])[:12],
            "top_ops": ops[:15]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", default="0.6B", choices=("tiny", "0.6B", "1.7B"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--voices", type=Path, default=VOICES, help="folder of reference clips (*.wav)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    device = torch.device(args.device)
    speaker, codec = build(args.size, device)
    clips = sorted(args.voices.glob("*.wav"))
    if not clips:
        raise SystemExit(f"no *.wav in {args.voices}")
    rows = []
    parts = ("resample", "mel", "speaker_net", "codec", "total")
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; torch {torch.__version__}; "
          f"size {args.size}; cuDNN off; ms")
    print("| clip | seconds | first call: " + " / ".join(parts) + " | repeat (median): " + " / ".join(parts) + " |")
    print("|---|---|---|---|")
    with torch.inference_mode(), torch.backends.cudnn.flags(enabled=False):
        for path in clips:
            data, sr = sf.read(path, dtype="float32")
            audio = resample(to_mono(data), sr, SAMPLE_RATE)
            first = encode_parts(speaker, codec, audio, device)
            repeats = [encode_parts(speaker, codec, audio, device) for _ in range(args.reps)]
            median = {k: statistics.median(r[k] for r in repeats) for k in parts}
            row = {"clip": path.name, "seconds": round(len(audio) / SAMPLE_RATE, 2),
                   "first": {k: round(v, 2) for k, v in first.items()},
                   "repeat": {k: round(v, 2) for k, v in median.items()}}
            rows.append(row)
            print(f"| {path.name} | {row['seconds']:.2f} | " + " / ".join(f"{first[k]:.1f}" for k in parts) + " | "
                  + " / ".join(f"{median[k]:.1f}" for k in parts) + " |", flush=True)
        profiles = {}
        if args.profile:
            audio = resample(to_mono(sf.read(clips[0], dtype="float32")[0]), sf.info(clips[0]).samplerate, SAMPLE_RATE)
            wav = resample(audio, SAMPLE_RATE, speaker.config.sample_rate)
            mels = mel_frontend.log_mel_spectrogram(torch.from_numpy(wav).unsqueeze(0).to(device))
            profiles = {"speaker_net": kernel_profile(lambda: speaker(mels), device),
                        "codec": kernel_profile(lambda: codec.encode([audio], SAMPLE_RATE), device)}
            for name, p in profiles.items():
                print(f"profile {name} ({clips[0].name}, a repeat): {p['kernels']} kernels, {p['kernel_ms']} ms of "
                      f"kernels in {p['wall_ms']} ms of wall time")
                print("  kernels by name: " + "; ".join(f"{n} x{c}" for n, c in p["top_kernels"]))
                print("  operators by calls: " + ", ".join(f"{n} x{c}" for n, c in p["top_ops"]))
    mean_first = statistics.mean(r["first"]["total"] for r in rows)
    mean_repeat = statistics.mean(r["repeat"]["total"] for r in rows)
    print(f"mean over {len(rows)} clips: first call {mean_first:.1f} ms, repeat {mean_repeat:.1f} ms")
    if args.json:
        args.json.write_text(json.dumps({"device": str(device), "size": args.size, "rows": rows,
                                         "profiles": profiles}, indent=1) + "\n")


if __name__ == "__main__":
    main()
