"""Per-frame decode time of the talker stage by batch size, eager vs CUDA graphs vs compiled layers + graphs,
against the HBM floor (weights read once per frame, plus each row's KV cache), on one GPU.

    python benchmarks/decode_bench.py --model DIR [--batches 1,8,32,64,128] [--variants eager,graph,compile]
        [--context 120] [--steps 30] [--json OUT.json] [--profile OUT.txt] [--tiles TILES.json] [--split]
        [--prompt-rows 256,512,1024 [--prompt-length 18]]

DIR is a checkpoint directory (random weights are used: --load-format dummy, so only its configs are read).
A frame here is what the engine's decode_step does: code 0 + 15 code-predictor passes + 16 draws + the next
talker step, with the codes read back to the host (the real critical path). The floor counts the bytes a
frame must read: talker + code-predictor weights once (15 code-predictor passes each re-read its layers,
which do not fit in L2), plus each row's KV cache up to --context; over the copy bandwidth measured here.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import torch


def copy_bandwidth(device, gib: float = 1.0) -> float:
    """Bytes read + written per second by a large device-to-device copy (median of 20)."""
    n = int(gib * 1024**3) // 2
    src = torch.randn(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * 2 / statistics.median(times[5:])


def frame_bytes(runner, batch: int, context: int) -> int:
    """Weights a frame reads (talker layers + head, code predictor layers x 15 passes + its heads) + KV."""
    talker = runner.talker

    def nbytes(module):
        return sum(p.numel() * p.element_size() for p in module.parameters())

    cp = talker.code_predictor
    passes = runner.num_groups - 1
    weights = nbytes(talker.model.layers) + nbytes(talker.codec_head) + passes * nbytes(cp.model.layers)
    weights += nbytes(cp.lm_head)  # each head once
    kv_per_token = runner.kv.k[:, 0, :, 0].numel() * runner.kv.k.element_size() * 2
    return weights + batch * context * kv_per_token


def prompt_text(context: int) -> str:
    """A text whose prompt takes ~context positions (~4 per word with the random tokenizer, + tags)."""
    return "word " * max(1, (context - 12) // 4)


def fill(runner, batch: int, context: int, spread: float = 0.0) -> None:
    """Prefill `batch` rows with prompts of ~context positions, or, with spread s, lengths evenly over
    context x [1 - s, 1 + s] (a served batch's rows differ in length; the KV bucket follows the longest)."""
    from serving.engine.request import GenerationRequest, SamplingParams

    for slot in range(runner.num_slots):
        if runner.lengths[slot]:
            runner.release(slot)
    lengths = [context * (1 - spread + 2 * spread * i / max(1, batch - 1)) for i in range(batch)]
    reqs = [(i, GenerationRequest(task="CustomVoice", text=prompt_text(int(n)), speaker="vivian", max_new_tokens=2000,
                                  sampling=SamplingParams(seed=i))) for i, n in enumerate(lengths)]
    for result in runner.prefill_many(reqs):
        if isinstance(result, Exception):
            raise result


def time_steps(runner, batch: int, steps: int) -> float:
    """ms per frame as the engine paces them: each step is launched before the previous one's codes are
    collected (a host poll between steps would add its sleep granularity, up to ~0.2 ms, to every frame)."""
    for _ in range(3):
        runner.decode_step(batch)
    longest = max(runner.lengths[:batch]) + steps + 1
    if runner.graphs is not None and not runner.graphs.covers(batch, runner.graph_kv(batch, longest)):
        print(f"warning: batch {batch} outgrows the captured KV buckets; late steps run eagerly", flush=True)
    t0 = time.perf_counter()
    handle = runner.launch(batch)
    for _ in range(steps - 1):
        following = runner.launch(batch)
        runner.collect(handle)
        handle = following
    runner.collect(handle)  # ends with the last codes on the host
    return (time.perf_counter() - t0) / steps * 1e3


def split_step(runner, batch: int, replays: int = 100) -> dict:
    """ms of each part of a frame at `batch` rows, each part captured alone as a CUDA graph and replayed: the
    talker's pass (TalkerRunner._talker), code 0 (the codec head with its penalties and masks, and its draw), the
    code predictor (15 passes, each with its head and draw), and of those two the 16 draws alone (the sampling:
    one over code 0's logits, 15 over the code predictor's). Where a served frame's time goes: issue 7 asks the
    per-frame breakdown beside a missed target. The parts' sum falls short of a whole frame by the frame's
    bookkeeping (the next input, counters) and the gaps between graphs."""
    from graph_timing import us_per_call

    b, kv_len = batch, max(runner.lengths[:batch]) + 1
    hidden = runner.hidden[:b]
    code0 = torch.zeros(b, dtype=torch.int64, device=runner.device)
    cp = runner.talker.code_predictor
    vocab0, vocab = runner.talker.codec_head.weight.shape[0], cp.lm_head[0].weight.shape[0]
    logits0 = torch.randn(b, vocab0, device=runner.device)
    logits = torch.randn(b, vocab, device=runner.device, dtype=runner.dtype)

    def draws():
        runner._draw(logits0, runner.talker_params, b, 0, True)
        for j in range(1, runner.num_groups):
            runner._draw(logits, runner.cp_params, b, j, True)

    parts = {
        "talker": lambda: runner._talker(b, kv_len),
        "code0": lambda: runner._draw(runner._code0_logits(hidden), runner.talker_params, b, 0, True),
        "code_predictor": lambda: runner._code_predictor(hidden, code0, b, True),
        "draws": draws,
    }
    torch.cuda.synchronize()  # the runner's tensors were made on its stream; the graphs capture on their own
    with torch.inference_mode():
        return {name: round(us_per_call(lambda _: part(), 1, replays) / 1e3, 3) for name, part in parts.items()}


def stage_prompts(runner, batch: int, rows: int, length: int) -> int:
    """Stage prompts of `length` positions (random inputs) for a step of `batch` rows to carry as prompt rows, as many
    as fill `rows` whole, through the engine's own layout (TalkerRunner._stage_prompt_rows: the slots' rows in
    turn, padding rows continuing the last prompt); returns the rows the step carries (0: it carries none)."""
    from types import SimpleNamespace

    hidden = runner.talker.cfg.transformer.hidden_size
    staged = [(i % batch, None, SimpleNamespace(prefill=torch.randn(length, hidden, device=runner.device)))
              for i in range(max(1, rows // length))]
    return runner._stage_prompt_rows(staged, batch)


def prompt_rows_step(runner, batch: int, sizes: list[int], length: int, replays: int = 50) -> dict:
    """ms of the talker's pass at `batch` rows alone and carrying each of `sizes` prompt rows (prompts of `length`
    positions), each captured alone as a CUDA graph and replayed: what an admission's prompts add to the step that
    carries them (TalkerRunner.stage, STEP_PROMPT_ROWS), against the pass alone (key '0'). The prompts' keys land in
    the batch's own slots: the timing needs no free ones, and fill() writes every row anew before the next batch."""
    from graph_timing import us_per_call

    kv_len = max(runner.lengths[:batch]) + 1
    torch.cuda.synchronize()
    with torch.inference_mode():
        times = {0: us_per_call(lambda _: runner._talker(batch, kv_len), 1, replays) / 1e3}
        for size in sizes:
            rows = stage_prompts(runner, batch, size, length)
            if rows:
                times[rows] = us_per_call(lambda _: runner._talker(batch, kv_len, rows), 1, replays) / 1e3
    return {str(rows): round(ms, 3) for rows, ms in times.items()}


def profile_step(runner, label: str, batch: int, path: str) -> None:
    """Kernel count and time by kernel name of steps run outside graphs (graphs hide their kernels from the
    profiler); the kernels are the ones a graph replays, without the launch gaps between them."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            runner._step(batch, max(runner.lengths[:batch]) + 1, True)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_frame = len(kernels) / 3, sum(e.device_time for e in kernels) / 3 / 1e3
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
    with open(path, "a") as f:
        f.write(f"\n=== {label}, batch {batch}: 3 steps outside graphs; per frame {per_frame[0]:.0f} kernels, "
                f"{per_frame[1]:.2f} ms of kernel time ===\n{table}\n")
    print(f"profile {label} batch {batch}: {per_frame[0]:.0f} kernels, {per_frame[1]:.2f} ms kernel time per frame",
          flush=True)


_EDGES: dict = {}  # the compiled pieces around the layers (TalkerRunner._compile), kept to switch them back on


def configure(runner, variant: str) -> None:
    """Set up the runner for a variant: compiled layers, and the experiments' changes to the default path."""
    from serving.engine.talker_stage import (FUSED_CP_ROWS, FUSED_TALKER_ROWS, WIDE_TALKER_ROWS, _torch_candidates,
                                             candidate_sampler)

    if variant.startswith("compile") and not runner.compile_layers:
        runner._compile()
        runner.compile_layers = True
        cp = runner.talker.code_predictor.model
        _EDGES["methods"] = {name: runner.__dict__[name] for name in ("_code0_logits", "_next_input", "_step_mask")}
        _EDGES["modules"] = {m: m._compiled_call_impl for m in (cp.norm, cp.rotary)}
    if _EDGES:  # compile-layers: only the decoder layers compiled (before the rest of the frame was)
        layers_only = variant == "compile-layers"
        for name, method in _EDGES["methods"].items():
            if layers_only:
                runner.__dict__.pop(name, None)
            else:
                setattr(runner, name, method)
        for module, impl in _EDGES["modules"].items():
            module._compiled_call_impl = None if layers_only else impl
    runner._sample_candidates = candidate_sampler(runner.device)
    # compile-modules: every step's code predictor through the compiled modules (before its fused Triton layers)
    runner.fused_cp_rows = FUSED_CP_ROWS if runner.fused_cp is not None and variant != "compile-modules" else 0
    # ...-fused-cp-N: the code predictor's fused layers for steps of up to N rows (compile-fused-cp-8: before s32)
    fused_cp = re.search(r"fused-cp-(\d+)", variant)
    if fused_cp and runner.fused_cp is not None:
        runner.fused_cp_rows = int(fused_cp.group(1))
    # compile-wide-modules: steps over FUSED_CP_ROWS rows run the code predictor's compiled modules (before the wide
    # layers: torch's products around the fused attention kernel)
    _EDGES.setdefault("wide_cp", runner.wide_cp)
    runner.wide_cp = None if variant == "compile-wide-modules" else _EDGES["wide_cp"]
    # compile-talker-modules: the talker's layers through the compiled modules at every batch (before its fused layers)
    # (and over every row count); ...-fused-talker-N: its fused layers for steps of up to N rows
    fused_talker = runner.fused_talker is not None and variant != "compile-talker-modules"
    fused_talker_rows = re.search(r"fused-talker-(\d+)", variant)
    runner.fused_talker_rows = (0 if not fused_talker else int(fused_talker_rows.group(1)) if fused_talker_rows
                                else FUSED_TALKER_ROWS)
    # compile-bucket-attention: the talker's steps of many rows through its compiled modules, attending over the whole
    # KV bucket through SDPA (before its wide layers); ...-wide-talker-N: its wide layers from N rows
    # (compile-wide-talker-32: before s32)
    _EDGES.setdefault("wide_talker", runner.wide_talker)
    runner.wide_talker = (None if variant in ("compile-bucket-attention", "compile-talker-modules")
                          else _EDGES["wide_talker"])
    wide_talker = re.search(r"wide-talker-(\d+)", variant)
    runner.wide_talker_rows = (None if runner.wide_talker is None else int(wide_talker.group(1)) if wide_talker
                               else WIDE_TALKER_ROWS)
    # compile-pdl-off: the fused layers launched plainly (before programmatic dependent launch)
    from serving.engine import triton_layers

    triton_layers.PDL = variant != "compile-pdl-off"
    if variant == "compile-torch-sampler":  # the torch candidate sampler compiled (before the Triton kernel)
        runner._sample_candidates = torch.compile(_torch_candidates, dynamic=True)
    if variant == "compile-cdt":  # gpt-fast's recipe: batch-1 matmuls become fused, tuned Triton reductions
        import torch._inductor.config as inductor_config

        inductor_config.coordinate_descent_tuning = True
        torch._dynamo.reset()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--variants", default="eager,graph,compile",
                    help="eager, graph, compile (compiled layers + graph); experiments on top of compile: "
                         "compile-layers, compile-torch-sampler, compile-cdt, compile-modules, compile-wide-modules, "
                         "compile-talker-modules, compile-bucket-attention, compile-pdl-off, compile-wide-talker-N, "
                         "compile-fused-cp-N, compile-fused-talker-N, together: compile-wide-talker-32-fused-cp-8 "
                         "(see configure)")
    ap.add_argument("--context", type=int, default=120, help="prompt positions per row before timing")
    ap.add_argument("--context-spread", type=float, default=0.0,
                    help="rows' prompt lengths spread evenly over context x [1 - s, 1 + s]")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--json")
    ap.add_argument("--profile", help="append per-kernel profiles of eager steps to this file")
    ap.add_argument("--split", action="store_true",
                    help="also time each part of a frame alone (split_step): talker, code 0, code predictor, draws")
    ap.add_argument("--prompt-rows", default="",
                    help="also time the talker's pass carrying these many prompt rows (e.g. 256,512,1024; "
                         "prompt_rows_step), at each batch whose steps carry prompts")
    ap.add_argument("--prompt-length", type=int, default=18,
                    help="positions of each carried prompt (custom voice, short text: ~18; voice clone: ~65)")
    ap.add_argument("--tiles", help="JSON of tiles for the fused code-predictor layers, by role "
                                    "(fused_layers_bench.py --json), instead of triton_layers._TILES")
    args = ap.parse_args()
    if args.tiles:
        from serving.engine import triton_layers

        with open(args.tiles) as f:
            for role, kinds in json.load(f).items():
                triton_layers._TILES[role].update({kind: tuple(tile) for kind, tile in kinds.items()})
        print("tiles", triton_layers._TILES, flush=True)

    from serving.engine.cuda_graphs import FrameGraphs, smallest_cover
    from serving.engine.engine import EngineConfig
    from serving.engine.loader import load_stages

    batches = [int(b) for b in args.batches.split(",")]
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    print(f"device {torch.cuda.get_device_name()}; torch {torch.__version__}; copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)
    config = EngineConfig(model=args.model, load_format="dummy", max_batch_size=max(batches),
                          max_model_len=args.max_model_len, enforce_eager=True, compile=False)
    runner, _codec, _info = load_stages(config)
    runner.warmup()
    # the KV buckets the timed steps meet: from the shortest prompt to the longest plus the steps
    low, high = args.context * (1 - args.context_spread) - 16, args.context * (1 + args.context_spread) + args.steps + 24
    lengths = [n for n in range(max(1, int(low)), int(high)) if smallest_cover(n, runner.kv_buckets) is not None]
    rows, results = [], {}
    for variant in args.variants.split(","):
        t0 = time.perf_counter()
        configure(runner, variant)
        if variant != "eager":
            runner.graphs = FrameGraphs(lambda b, kv: runner._step(b, kv, True), device)
            runner.graph_buckets = tuple(batches)
            fill(runner, 0, args.context)
            with torch.inference_mode():
                for b in batches:
                    for kv in sorted({runner.graph_kv(b, n) for n in lengths}):
                        runner.graphs.capture(b, kv)
        setup = time.perf_counter() - t0
        for b in batches:
            fill(runner, b, args.context, args.context_spread)
            context = round(sum(runner.lengths[:b]) / b)
            ms = time_steps(runner, b, args.steps)
            floor = frame_bytes(runner, b, context) / bandwidth * 1e3
            results[(variant, b)] = ms
            rows.append({"variant": variant, "batch": b, "context": context, "ms_per_frame": round(ms, 3),
                         "floor_ms": round(floor, 3), "x_floor": round(ms / floor, 2),
                         "frames_per_s": round(b / ms * 1e3, 1), "x_realtime_per_stream": round(1e3 / ms / 12.5, 2),
                         "setup_s": round(setup, 1)})
            if args.split and variant != "eager":
                parts = split_step(runner, b)
                parts["rest"] = round(ms - parts["talker"] - parts["code0"] - parts["code_predictor"], 3)
                rows[-1]["split_ms"] = parts
            if args.prompt_rows and variant != "eager" and runner.takes_prompts(b):
                rows[-1]["prompt_length"] = args.prompt_length
                rows[-1]["prompt_rows_ms"] = prompt_rows_step(
                    runner, b, [int(n) for n in args.prompt_rows.split(",")], args.prompt_length)
            print(json.dumps(rows[-1]), flush=True)
        if args.profile and variant != "graph":
            for b in (batches[0], batches[-1]):
                fill(runner, b, args.context, args.context_spread)
                profile_step(runner, variant, b, args.profile)
    print("\nvariant  batch  ms/frame  floor_ms  x_floor  frames/s  x_realtime/stream")
    for r in rows:
        print(f"{r['variant']:8s} {r['batch']:5d} {r['ms_per_frame']:9.2f} {r['floor_ms']:9.2f} {r['x_floor']:8.1f} "
              f"{r['frames_per_s']:9.0f} {r['x_realtime_per_stream']:10.1f}")
    split = [r for r in rows if "split_ms" in r]
    if split:
        print("\nparts alone, ms (the rest: bookkeeping and gaps)\nvariant  batch  frame  talker  code0  code_predictor"
              "  of which draws  rest")
        for r in split:
            p = r["split_ms"]
            print(f"{r['variant']:8s} {r['batch']:5d} {r['ms_per_frame']:6.2f} {p['talker']:7.2f} {p['code0']:6.2f} "
                  f"{p['code_predictor']:15.2f} {p['draws']:15.2f} {p['rest']:5.2f}")
    carried = [r for r in rows if "prompt_rows_ms" in r]
    if carried:
        print("\nthe talker's pass carrying prompt rows, ms (prompts of --prompt-length positions)\nvariant  batch  "
              "prompt rows: ms")
        for r in carried:
            print(f"{r['variant']:8s} {r['batch']:5d}  " + "  ".join(f"{n}: {ms:.2f}"
                                                                  for n, ms in r["prompt_rows_ms"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "copy_bandwidth_Bps": bandwidth, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
