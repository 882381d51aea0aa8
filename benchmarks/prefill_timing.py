"""Where one request's prefill goes on a GPU: prompt building, the talker's pass, the slot's setup.

    python benchmarks/prefill_timing.py --model DIR [--configs eager,compiled,graphs] [--profile OUT.txt]

The served first audio of a lone request is prefill + first chunk frames + one codec call (the engine's phases,
benchmarks/engine_phases.py); this splits the prefill, eager, with compiled layers, and as served (compiled layers and
CUDA graphs: prefill graphs per prompt-length bucket), new prompt lengths included since a compiled layer may
specialise on them; and profiles one call of the last configuration by operator.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

TEXTS = ["Could you repeat that, please?", "Please hold the line for a moment.", "What time is it now?",
         "The regional transport authority announced on Monday that ticket prices will rise by an average of four "
         "percent from the first of July."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--configs", default="eager,compiled,graphs")
    ap.add_argument("--profile")
    args = ap.parse_args()

    from serving.engine.engine import EngineConfig
    from serving.engine.loader import load_stages
    from serving.engine.request import GenerationRequest

    def request(text):
        return GenerationRequest(task="CustomVoice", text=text, speaker="vivian", max_new_tokens=900)

    def wall(fn) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    names = {"eager": "eager", "compiled": "compiled layers", "graphs": "compiled layers + CUDA graphs"}
    configs = args.configs.split(",")
    for name in configs:
        config = EngineConfig(model=args.model, load_format="dummy", max_batch_size=8, max_model_len=1024,
                              ignore_eos=True, enforce_eager=name != "graphs", compile=name != "eager")
        runner, _codec, _info = load_stages(config)
        runner.warmup()
        cache = runner._voice_cache_lookup
        rows = []
        for rep in range(3):
            for i, text in enumerate(TEXTS):
                slot = i % runner.num_slots
                runner.release(slot)
                req = request(text + " " * rep)
                build = wall(lambda: runner.prompts.build_many([req], cache))
                total = wall(lambda: runner.prefill_many([(slot, req)]))
                positions = runner.prompts.build_many([req], cache)[0][0].prefill.shape[0]
                rows.append((rep, len(text), positions, build, total))
        print(f"== {names[name]}: (repeat, chars, prompt positions, build ms, prefill_many ms)")
        for r in rows:
            print("  ", r[0], r[1], r[2], f"{r[3]:.1f}", f"{r[4]:.1f}")
        print(f"  median prefill_many {statistics.median(r[4] for r in rows[4:]):.1f} ms, build "
              f"{statistics.median(r[3] for r in rows[4:]):.1f} ms", flush=True)
        if name == configs[-1] and args.profile:
            from torch.profiler import ProfilerActivity, profile

            runner.release(0)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                runner.prefill_many([(0, request(TEXTS[0]))])
                torch.cuda.synchronize()
            with open(args.profile, "w") as f:
                f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=80))
                f.write("\n")
                f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=80))
        del runner
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
