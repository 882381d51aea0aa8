"""Does a staged admission leave the talker's state as a prefill before the step after it would, on this device?
Exit 1 where it does not.

TalkerRunner.stage puts requests admitted while a step is in flight into the next launch: a step of the wide talker
layers carries their prompt positions as rows of its own, else their passes follow the step. Two schedules on one
runner: --running requests decoding, --admit more admitted after --steps steps, staged (the new path) or, the
reference, a plain step and then prefill_many. After the step the admission rides, the running rows' hidden states,
the new requests' last hidden states and their slots' keys and values are compared, relative to the reference's
largest magnitude. Codes are no check on a GPU: a step that carries prompt rows multiplies more rows at once, and
cuBLAS's bfloat16 sums for a row change with the rows of the call (H100: 1.4e-2 to 2.4e-2 here, where the plain step
replayed by the graph of 48 rows moved the running rows' hidden states by 3.0e-1; docs/performance.md, thirty-first
pass); --noise-graph B prints that noise for a graph of B rows. On a CPU the wide layers run only with
--force-triton, in Triton's interpreter (TRITON_INTERPRET=1); without, the passes follow the step.

    python3 benchmarks/staged_admission_check.py --model CKPT --load-format dummy   # CUDA
    .venv/bin/python benchmarks/staged_admission_check.py                           # CPU, the tiny checkpoint
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from serving.engine.checkpoint import resolve_model  # noqa: E402
from serving.engine.engine import EngineConfig  # noqa: E402
from serving.engine.loader import load_stages  # noqa: E402
from serving.engine.request import GenerationRequest, SamplingParams  # noqa: E402
from serving.engine.talker_stage import fused_stack  # noqa: E402

TEXTS = ["Hello there, how are you today?", "It's twenty past seven.", "A much longer sentence that goes on and on, "
         "with more words in it than the others have.", "Short.", "Numbers: one, two, three, four, five.",
         "The quick brown fox jumps over the lazy dog."]


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the tiny random one)")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    parser.add_argument("--running", type=int, default=8, help="requests decoding before the admission")
    parser.add_argument("--admit", type=int, default=6, help="requests the admission stages")
    parser.add_argument("--steps", type=int, default=3, help="steps before the admission")
    parser.add_argument("--tolerance", type=float, default=5e-2)
    parser.add_argument("--noise-graph", type=int, default=None, help="also replay the plain step by this graph")
    parser.add_argument("--force-triton", action="store_true", help="the wide talker layers on any device")
    args = parser.parse_args(argv)
    slots = args.running + args.admit
    model = args.model or str(resolve_model("tiny-random"))
    config = EngineConfig(model=model, load_format=args.load_format, max_batch_size=max(slots, args.noise_graph or 0),
                          max_model_len=512, ignore_eos=True)
    runner, _codec, _info = load_stages(config)
    if args.force_triton:
        runner.wide_talker = fused_stack(runner.talker.model, runner.device, force=True, wide=True)
        runner.wide_talker_rows = 3
        runner.set_up_prompt_rows()
    runner.warmup()
    bucket = next(b for b in runner.buckets if b >= slots)
    reqs = [GenerationRequest(task="CustomVoice", text=TEXTS[i % len(TEXTS)], speaker="vivian", max_new_tokens=200,
                              sampling=SamplingParams(seed=100 + i)) for i in range(slots)]
    new = [(s, reqs[s]) for s in range(args.running, slots)]
    lengths = [prompt.prefill.shape[0] for prompt, _ in
               runner.prompts.build_many([r for _, r in new], lambda key, compute: compute())]
    carried = []
    stage_rows = runner._stage_prompt_rows
    runner._stage_prompt_rows = lambda staged, b: carried.append(stage_rows(staged, b)) or carried[-1]

    def state(kind: str) -> tuple[torch.Tensor, ...]:
        runner.release(*range(runner.num_slots))
        runner.prefill_many([(s, reqs[s]) for s in range(args.running)])
        for _ in range(args.steps):
            runner.collect(runner.launch(bucket))
        if kind == "staged":
            if not runner.stage(new)[1]:
                raise SystemExit(f"{sum(lengths)} prompt positions are a burst, prefilled at once: admit fewer")
            runner.collect(runner.launch(bucket))
        else:
            runner.collect(runner.launch(args.noise_graph if kind == "noise" else bucket))
            runner.prefill_many(new)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        cache = [torch.cat([runner.kv.k[:, s, :, :n].flatten(), runner.kv.v[:, s, :, :n].flatten()])
                 for (s, _), n in zip(new, lengths)]
        return (runner.hidden[:args.running].float().clone(), runner.hidden[args.running:slots].float().clone(),
                torch.cat(cache).float())

    want = state("plain")
    got = state("staged")
    names = ("running rows' hidden", "new rows' last hidden", "new slots' keys and values")
    if args.noise_graph:
        noise = state("noise")
        print("plain step by the graph of", args.noise_graph, "rows:",
              "; ".join(f"{name} {relative(n, w):.2e}" for name, n, w in zip(names, noise, want)))
    diffs = [relative(g, w) for g, w in zip(got, want)]
    ok = all(d <= args.tolerance for d in diffs)
    print(f"{args.admit} staged into {args.running} running ({sum(lengths)} prompt positions; prompt rows carried: "
          f"{carried[0] or 'none, passes after the step'}): " + ", ".join(f"{n} {d:.2e}" for n, d in zip(names, diffs))
          + f" -> {'OK' if ok else 'MISMATCH'} (tolerance {args.tolerance:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
