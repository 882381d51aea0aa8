"""Where a new reference voice's encoding goes: the speaker encoder (x-vector) and the codec encoder (reference
codes) over each clip of datasets/voices, as the server runs them for a voice clone it has not met.

    python benchmarks/voice_encode_bench.py [--device cuda] [--size 0.6B] [--reps 3] [--profile]
                                            [--parallel 1,2,4] [--busy 2] [--eager] [--json OUT.json]

Served on an H100, a clone level's first requests waited 70-120 ms each on their new voice (phase prefill at c=1,
docs/performance.md), more than the ~40 ms an earlier measurement of one clip gave. This times, per clip, the
speaker encoder's parts (resampling on the host, the log-mel front end, the network) and the codec encoder's
encode, each synchronised, on a clip's first call (a length the process has not met: what a new voice costs) and
the median of --reps repeats; with cuDNN off, as serving.engine.prompts runs them. --profile counts the kernels
of one repeat of each encoder and their summed GPU time, against its wall time: far apart, the encoder is bound by
its launches, not the GPU. Random weights of the released architectures (the sizes' speaker encoder configs and the
released 12 Hz speech tokenizer; `--size tiny`: the tests' small ones), built in memory: no checkpoint needed.
Both networks run as TorchScript, unoptimised, as the server runs them since session 39 (serving.engine.prompts);
--eager runs the modules' Python forward instead, as the server did before: the same operators, each taking the
interpreter back after its launch.

--parallel N,... asks how many new voices a second N encoders sharing the work reach, as threads of one process
(the engine's voice threads; each thread on its own CUDA stream) and as processes of their own (spawned, each with
its own encoders and CUDA context): on an H100 beside two busy threads, 1 / 2 / 3 / 4 threads encoded 41.4 / 75.2 /
121.5 / 142.8 new voices a second in TorchScript (processes 58.5 / 50.9 / 24.6 / 17.6; docs/performance.md
thirty-fifth pass; eager, 1 / 2 threads: 21.4 / 36.9, thirty-fourth). Each encoding is the server's (x-vector
and codes copied to the host) of a clip a few samples shorter than the last, a length the encoders have not met.
A GPU question: on a CPU each process also brings its own pool of compute threads, which contend for the cores (the
2-core VM, tiny encoders: 1 / 2 threads 22.0 / 41.5 voices a second, 1 / 2 processes 35.8 / 9.6). --busy N runs N
threads beside them that launch small operators on the device without pause, as a served engine's talker and codec
threads take the interpreter in turn with the voice threads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import statistics
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from serving.engine.prompts import as_torchscript
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


def scripted(speaker, codec, eager: bool) -> tuple:
    """(speaker net, codec net) as the server runs them (TorchScript), or with --eager the modules themselves."""
    return (speaker, codec) if eager else (as_torchscript(speaker), as_torchscript(codec))


def encode_parts(speaker, codec, nets: tuple, audio: np.ndarray, device: torch.device) -> dict[str, float]:
    """ms of each part of one voice's encoding (SpeakerEncoder.embed's steps, then CodecEncoder.encode)."""
    wav, resample_ms = timed(lambda: resample(audio, SAMPLE_RATE, speaker.config.sample_rate), device)
    mels, mel_ms = timed(lambda: mel_frontend.log_mel_spectrogram(torch.from_numpy(wav).unsqueeze(0).to(device)),
                         device)
    _, net_ms = timed(lambda: nets[0](mels), device)
    _, codec_ms = timed(lambda: codec.encode([audio], SAMPLE_RATE, net=nets[1]), device)
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


def encode_voice(speaker, codec, nets: tuple, audio: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """A new voice as the server encodes it (serving.engine.prompts.PromptBuilder.encode_reference): x-vector and
    reference codes, both on the host."""
    with torch.jit.optimized_execution(False):
        return (speaker.embed(audio, SAMPLE_RATE, net=nets[0]).float().cpu(),
                codec.encode([audio], SAMPLE_RATE, net=nets[1])[0].cpu())


_worker: dict = {}  # a spawned worker's encoders


def _worker_start(size: str, device: str, warm_up: np.ndarray, eager: bool) -> None:
    torch.backends.cudnn.enabled = False  # as served; a process of its own has no one else to keep it for
    _worker["device"] = torch.device(device)
    speaker, codec = build(size, _worker["device"])
    _worker["encoders"] = (speaker, codec, scripted(speaker, codec, eager))
    _encode_in_worker(warm_up)  # the process's first encoding sets up its libraries (0.77 s on an H100)


def _encode_in_worker(audio: np.ndarray) -> int:
    with torch.inference_mode():
        return encode_voice(*_worker["encoders"], audio)[1].shape[0]


@contextlib.contextmanager
def busy_threads(n: int, device: torch.device):
    """n threads launching small operators on `device` (each lets go of the interpreter and takes it back) until
    the block ends."""
    stop = threading.Event()

    def launch():
        x = torch.zeros(64, device=device)
        while not stop.is_set():
            x.add_(1)

    threads = [threading.Thread(target=launch, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join()


def parallel_rate(kind: str, workers: int, clips: list[np.ndarray], speaker, codec, nets: tuple, size: str,
                  device: torch.device) -> float:
    """New voices a second that `workers` threads (sharing speaker and codec) or spawned processes reach over
    `clips`, the pool started and warmed before the clock starts."""
    if kind == "processes":
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_start,
                                   initargs=(size, str(device), clips[0], nets[0] is speaker))
        for f in [pool.submit(_encode_in_worker, clips[0]) for _ in range(workers)]:  # every process started
            f.result()

        def job(audio):
            return pool.submit(_encode_in_worker, audio)
    else:
        pool, streams = ThreadPoolExecutor(workers), threading.local()

        def encode(audio):
            own_stream = contextlib.nullcontext()
            if device.type == "cuda":
                if not hasattr(streams, "stream"):
                    streams.stream = torch.cuda.Stream(device)
                own_stream = torch.cuda.stream(streams.stream)
            with torch.inference_mode(), own_stream:
                return encode_voice(speaker, codec, nets, audio)

        def job(audio):
            return pool.submit(encode, audio)
    try:
        t0 = time.perf_counter()
        for f in [job(audio) for audio in clips]:
            f.result()
        return len(clips) / (time.perf_counter() - t0)
    finally:
        pool.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", default="0.6B", choices=("tiny", "0.6B", "1.7B"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--voices", type=Path, default=VOICES, help="folder of reference clips (*.wav)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--parallel", default="", help="encoders sharing the work, e.g. 1,2,4: new voices a second")
    ap.add_argument("--parallel-voices", type=int, default=32, help="encodings each --parallel figure shares")
    ap.add_argument("--busy", type=int, default=0, help="threads launching small operators beside --parallel")
    ap.add_argument("--eager", action="store_true", help="the modules' Python forward, not TorchScript")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    device = torch.device(args.device)
    speaker, codec = build(args.size, device)
    nets = scripted(speaker, codec, args.eager)
    clips = sorted(args.voices.glob("*.wav"))
    if not clips:
        raise SystemExit(f"no *.wav in {args.voices}")
    rows = []
    parts = ("resample", "mel", "speaker_net", "codec", "total")
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; torch {torch.__version__}; "
          f"size {args.size}; cuDNN off; {'eager' if args.eager else 'TorchScript'}; ms")
    print("| clip | seconds | first call: " + " / ".join(parts) + " | repeat (median): " + " / ".join(parts) + " |")
    print("|---|---|---|---|")
    with torch.inference_mode(), torch.backends.cudnn.flags(enabled=False), torch.jit.optimized_execution(False):
        for path in clips:
            data, sr = sf.read(path, dtype="float32")
            audio = resample(to_mono(data), sr, SAMPLE_RATE)
            first = encode_parts(speaker, codec, nets, audio, device)
            repeats = [encode_parts(speaker, codec, nets, audio, device) for _ in range(args.reps)]
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
            profiles = {"speaker_net": kernel_profile(lambda: nets[0](mels), device),
                        "codec": kernel_profile(lambda: codec.encode([audio], SAMPLE_RATE, net=nets[1]), device)}
            for name, p in profiles.items():
                print(f"profile {name} ({clips[0].name}, a repeat): {p['kernels']} kernels, {p['kernel_ms']} ms of "
                      f"kernels in {p['wall_ms']} ms of wall time")
                print("  kernels by name: " + "; ".join(f"{n} x{c}" for n, c in p["top_kernels"]))
                print("  operators by calls: " + ", ".join(f"{n} x{c}" for n, c in p["top_ops"]))
    parallel = []
    if args.parallel:
        sources = [resample(to_mono(d), sr, SAMPLE_RATE) for d, sr in (sf.read(c, dtype="float32") for c in clips)]
        used = 0

        def fresh() -> list[np.ndarray]:  # each a length not met before: 7 samples shorter than the last one's cut
            nonlocal used
            cuts = range(used + 1, used + 1 + args.parallel_voices)
            used += args.parallel_voices
            return [sources[i % len(sources)][: len(sources[i % len(sources)]) - 7 * i] for i in cuts]

        print(f"beside {args.busy} busy threads" if args.busy else "nothing beside")
        print("| encoders | threads: new voices / s | processes: new voices / s |")
        print("|---|---|---|")
        for n in (int(x) for x in args.parallel.split(",")):
            with torch.backends.cudnn.flags(enabled=False), busy_threads(args.busy, device):
                rates = {kind: parallel_rate(kind, n, fresh(), speaker, codec, nets, args.size, device)
                         for kind in ("threads", "processes")}
            parallel.append({"workers": n, **{k: round(v, 2) for k, v in rates.items()}})
            print(f"| {n} | {rates['threads']:.1f} | {rates['processes']:.1f} |", flush=True)
    mean_first = statistics.mean(r["first"]["total"] for r in rows)
    mean_repeat = statistics.mean(r["repeat"]["total"] for r in rows)
    print(f"mean over {len(rows)} clips: first call {mean_first:.1f} ms, repeat {mean_repeat:.1f} ms")
    if args.json:
        args.json.write_text(json.dumps({"device": str(device), "size": args.size, "eager": args.eager,
                                         "busy": args.busy, "rows": rows,
                                         "profiles": profiles, "parallel": parallel}, indent=1) + "\n")


if __name__ == "__main__":
    main()
