"""Where a burst's prefill goes: N requests admitted together, as a closed-loop level's first wave is.

    python benchmarks/burst_prefill.py --model DIR [--task custom|clone] [--bursts 8,31,127] [--sets short,long]
                                       [--json OUT.json] [--profile OUT.txt] [--token-budgets 8192,16384] [--no-graphs]

The server's request log (benchmarks/request_timeline.py) shows the first wave of a c=32 or c=128 level waiting
on one prefill of all its prompts; this times that call (TalkerRunner.prefill_many, CUDA synchronised) and its
parts on a warmed runner, with the texts of the built-in sets: building the prompts, the talker's pass over
them with the copies into the slots' caches, the slots' setup, and the rest. Each cell is the median of --reps
calls (each part synchronised on its own, so the parts add up to a little more than an unobserved call); the
first call of each burst is reported apart, since a server meets each (rows, length) shape for the first time
as it comes (kernel plans and allocations made per shape). --task clone (a Base checkpoint) sends the built-in
reference voices in turn, encoded once beforehand as the engine's voice thread leaves them (x-vector and codes on
the host), with their transcripts (in-context cloning), each cell twice: voices the prompt builder has seen (their
prompt pieces kept on the device) and voices new to it (those pieces built in the call, as for a voice's first
request).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--task", choices=("custom", "clone"), default="custom",
                    help="custom: CustomVoice requests; clone: Base requests of the built-in reference voices")
    ap.add_argument("--bursts", default="8,31,127")
    ap.add_argument("--sets", default="short,long")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--token-budgets", default="",
                    help="Prompt positions per batched pass to compare, each cell run under each in turn "
                         "(serving.engine.talker_stage.PREFILL_TOKEN_BUDGET); default: the stack's own.")
    ap.add_argument("--no-graphs", action="store_true",
                    help="every group through the batched pass, none through the prefill graphs (the path before them)")
    ap.add_argument("--profile", type=Path,
                    help="Profile by operator (host time) the last set's largest burst less one request: a first call, "
                         "as a server meets a new shape.")
    args = ap.parse_args()

    from serving.engine import talker_stage
    from serving.engine.checkpoint import resolve_model
    from serving.engine.engine import EngineConfig
    from serving.engine.loader import load_stages
    from serving.engine.request import GenerationRequest
    from ttsbench.datasets import load_set

    bursts = [int(b) for b in args.bursts.split(",")]
    budgets = [int(b) for b in args.token_budgets.split(",") if b] or [talker_stage.PREFILL_TOKEN_BUDGET]
    config = EngineConfig(model=str(resolve_model(args.model)), load_format="dummy", max_batch_size=max(bursts), max_model_len=1024,
                          ignore_eos=True)
    runner, _codec, _info = load_stages(config)
    runner.warmup()
    if args.no_graphs:
        runner.prefill_graphs = None

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def sync_ms(fn) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return (time.perf_counter() - t0) * 1e3

    parts = {"build": 0.0, "pass": 0.0, "slots": 0.0}
    positions: list[int] = []  # the prompt lengths of the last burst built
    real_build, real_groups, real_init = runner.prompts.build_many, runner._prefill_groups, runner._init_slots

    def timed_build(*a, **k):
        t0 = time.perf_counter()
        out = real_build(*a, **k)
        sync()
        parts["build"] += (time.perf_counter() - t0) * 1e3
        positions[:] = [p[0].prefill.shape[0] for p in out]
        return out

    def timed_groups(built):
        parts["pass"] += sync_ms(lambda: real_groups(built))

    def timed_init(*a):
        parts["slots"] += sync_ms(lambda: real_init(*a))

    runner.prompts.build_many, runner._prefill_groups, runner._init_slots = timed_build, timed_groups, timed_init
    voices = encoded_voices(runner) if args.task == "clone" else []
    rows = []
    for set_name in args.sets.split(","):
        items = load_set(set_name)
        for n in bursts:
            texts = [items[i % len(items)].text for i in range(n)]
            if voices:
                reqs = [GenerationRequest(task="Base", text=t, max_new_tokens=900, **voices[i % len(voices)])
                        for i, t in enumerate(texts)]
            else:
                reqs = [GenerationRequest(task="CustomVoice", text=t, speaker="vivian", max_new_tokens=900)
                        for t in texts]
            for budget, voices_new in itertools.product(budgets, (False, True) if voices else (None,)):
                talker_stage.PREFILL_TOKEN_BUDGET = budget
                cells = []
                for _ in range(args.reps + 1):  # a shape's first call is reported apart: a server meets new shapes
                    for slot in range(n):
                        runner.release(slot)
                    if voices_new:  # the voices' prompt pieces as the burst's first requests of each voice meet them
                        runner.prompts.builder._voice_memo.clear()
                    parts.update({"build": 0.0, "pass": 0.0, "slots": 0.0})
                    total = sync_ms(lambda: runner.prefill_many(list(enumerate(reqs))))
                    cells.append((total, parts["build"], parts["pass"] - parts["slots"], parts["slots"]))
                first, cells = cells[0], cells[1:]
                total, build, pass_, slots = (statistics.median(c[i] for c in cells) for i in range(4))
                row = {"task": args.task, "voices": {None: None, False: "seen", True: "new"}[voices_new],
                       "set": set_name, "burst": n, "token_budget": budget, "graphs": runner.prefill_graphs is not None,
                       "positions_mean": round(sum(positions) / n, 1), "positions_max": max(positions),
                       "total_ms": round(total, 2), "build_ms": round(build, 2), "pass_ms": round(pass_, 2),
                       "slots_ms": round(slots, 2), "rest_ms": round(total - build - pass_ - slots, 2),
                       "first_call": dict(zip(("total_ms", "build_ms", "pass_ms", "slots_ms"),
                                              (round(f, 2) for f in first)))}
                rows.append(row)
                how = "graphs" if row["graphs"] else "batched passes"
                print(f"  {args.task}{'' if voices_new is None else ' (voices ' + row['voices'] + ')'} "
                      f"{set_name:5s} burst {n:3d} budget {budget:5d} {how:20s}: {row['positions_mean']:.0f} "
                      f"positions mean ({row['positions_max']} max)  prefill_many {total:7.1f} ms = build "
                      f"{build:6.1f} + pass {pass_:6.1f} + slot setup {slots:5.1f} + rest {row['rest_ms']:5.1f}  "
                      f"({total / n:.2f} ms per request); first call {first[0]:.1f} = {first[1]:.1f} + "
                      f"{first[2]:.1f} + {first[3]:.1f} + ...", flush=True)
            if args.profile and set_name == args.sets.split(",")[-1] and n == bursts[-1]:
                from torch.profiler import ProfilerActivity, profile

                runner.prompts.build_many, runner._prefill_groups = real_build, real_groups
                runner._init_slots = real_init
                for slot in range(n):
                    runner.release(slot)
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    runner.prefill_many(list(enumerate(reqs[:-1])))  # one request less: a shape not met yet
                    sync()
                table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25,
                                                  max_name_column_width=60)
                args.profile.write_text(table)
                print(table)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "rows": rows}, indent=1) + "\n")


def encoded_voices(runner) -> list[dict]:
    """The built-in reference voices as a voice clone request carries them once encoded: x-vector and codes on
    the host (PromptBuilder.encode_reference), the clip's transcript."""
    import soundfile as sf

    from serving.model.config import SAMPLE_RATE
    from serving.model.resample import resample, to_mono
    from ttsbench.datasets import load_voices

    out = []
    for voice in load_voices():
        data, rate = sf.read(voice.path, dtype="float32")
        encoded = runner.prompts.encode_reference(resample(to_mono(data), rate, SAMPLE_RATE))
        out.append({"encoded_voice": encoded, "ref_text": voice.ref_text})
    return out


if __name__ == "__main__":
    main()
