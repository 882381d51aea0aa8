"""How long does `ttsbench quality` take per clip, by ASR and speaker backend?

Builds a run directory of N espeak-ng clips of the built-in `short` set (English, four espeak voices,
24 kHz as a TTS server sends them, recorded as CustomVoice requests so speaker consistency is scored
too), then scores it with each backend combination exactly as `ttsbench quality` does (score_run) and
reports model load time, seconds per clip and the WER found. Plan quality runs with it (e.g. whisper
large-v3 on a GPU) and record results in docs/performance.md with the load average printed.

    .venv/bin/python benchmarks/quality_speed.py                          # 12 clips, CPU, whisper base
    .venv/bin/python benchmarks/quality_speed.py --clips 50 --device cuda --asr-model large-v3
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.quality_support import espeak, record, write_run  # noqa: E402
from ttsbench.datasets import load_set  # noqa: E402
from ttsbench.quality.scoring import Backends, Options, score_run  # noqa: E402

VOICES = ("en-us", "en+f3", "en-us+m3", "en-gb+f2")


def build_run(run_dir: Path, clips: int) -> None:
    items = load_set("short")
    records = []
    for i in range(clips):
        item, voice = items[i % len(items)], VOICES[i % len(VOICES)]
        espeak(run_dir / "audio" / f"{i}.wav", item.text, voice)
        records.append(record(f"custom/short/c1/{i}", "custom", "short", item.text, f"audio/{i}.wav",
                              voice=voice, language=item.language))
    write_run(run_dir, records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clips", type=int, default=12)
    parser.add_argument("--asr", default="whisper,faster-whisper", help="comma-separated ASR backends")
    parser.add_argument("--asr-model", default="base")
    parser.add_argument("--sim", default="resemblyzer")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        build_run(run_dir, args.clips)
        print(f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()} {os.cpu_count()} CPUs, "
              f"load avg {os.getloadavg()[0]:.1f}, {args.clips} clips, device {args.device}")
        for asr in args.asr.split(","):
            options = Options(asr=asr, asr_model=args.asr_model, sim=args.sim, device=args.device)
            t0 = time.perf_counter()
            Backends(options)  # load once to time it; score_run loads its own (now from the OS file cache)
            load_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            (row,) = score_run(run_dir, options)
            per_clip = (time.perf_counter() - t0) / args.clips
            print(f"  asr {asr} {args.asr_model} + sim {args.sim}: load {load_s:.1f} s, "
                  f"{per_clip:.2f} s per clip (load included once), WER mean {row['wer_mean']:.3f} "
                  f"({row['wer_n']}), SIM {row['sim_mean']} ({row['sim_n']}), flagged {row['flagged_share']:.0%}")


if __name__ == "__main__":
    main()
