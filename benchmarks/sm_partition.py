"""Two stages on one GPU: a chain of small dependent kernels (the talker's frame) beside large convolutions (the
codec's vocoder), with and without a CUDA green context that keeps the convolutions off some of the SMs.

    python benchmarks/sm_partition.py [--codec-sms 0,66,100,116] [--json OUT.json]

stage_timing.py found the talker's 128-row step 3x slower beside the codec's calls (7 -> 21 ms) whatever the
streams' priorities: each of the frame's ~1,600 small kernels waits for SMs that the codec's blocks hold. This
times a stand-in of each (no checkpoint needed): the small chain replayed as one CUDA graph on its own stream,
the convolutions looped in a second thread (eager and as a replayed graph), alone and side by side, the second
thread's work placed on a green context of --codec-sms SMs (0: the whole GPU, as the stack runs). The stack
itself ran its codec so confined in session 15 (commit 721b6b3); served, it did not pay and was taken out
(docs/performance.md, twelfth pass).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch
from graph_timing import captured_on


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--codec-sms", default="0,66,100,116")
    ap.add_argument("--kernels", type=int, default=800, help="small kernels in the talker stand-in's chain")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms_total = torch.cuda.get_device_properties(dev).multi_processor_count
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "sms": sms_total, "rows": []}
    from torch.cuda import green_contexts

    print("green contexts supported:", green_contexts.SUPPORTED, "members:",
          [m for m in dir(green_contexts.GreenContext) if not m.startswith("_")], flush=True)

    # the talker stand-in: 128 rows through small products and activations, one graph on a high-priority stream
    x = torch.randn(128, 1024, device=dev, dtype=torch.bfloat16)
    ws = [torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16) * 0.03 for _ in range(8)]

    def chain():
        y = x
        for i in range(args.kernels // 2):
            y = torch.nn.functional.silu(y @ ws[i % 8])
        return y

    talker = torch.cuda.Stream(priority=-1)
    graph = captured_on(talker, chain)

    def talker_step():
        with torch.cuda.stream(talker):
            graph.replay()
        talker.synchronize()

    def codec_setup(stream):
        """Convolutions of the vocoder's last two stages at 16 x 25 frames, on `stream`; eager and graphed."""
        with torch.cuda.stream(stream):
            a = torch.randn(16, 96, 48000, device=dev, dtype=torch.bfloat16)
            b = torch.randn(16, 384, 4000, device=dev, dtype=torch.bfloat16)
            c1 = torch.nn.Conv1d(96, 96, 7, padding=3).to(dev, torch.bfloat16)
            c2 = torch.nn.Conv1d(384, 384, 7, padding=3).to(dev, torch.bfloat16)

            def work():
                with torch.no_grad():
                    for _ in range(3):
                        c1(torch.nn.functional.silu(a))
                        c2(torch.nn.functional.silu(b))
            work()
        stream.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            work()
        stream.synchronize()

        def eager():
            with torch.cuda.stream(stream):
                work()
            stream.synchronize()

        def graphed():
            with torch.cuda.stream(stream):
                g.replay()
            stream.synchronize()
        return {"eager": eager, "graph": graphed}

    out["talker_alone_ms"] = median_ms(talker_step, 30)
    print(f"talker stand-in alone: {out['talker_alone_ms']} ms", flush=True)
    for sms in [int(s) for s in args.codec_sms.split(",")]:
        ready, stop, result = threading.Event(), threading.Event(), {}
        mode_box = {"mode": None}

        def codec_thread():
            try:
                if sms:  # kept alive by this frame for as long as its stream is used
                    ctx = green_contexts.GreenContext.create(num_sms=sms, device_id=0)
                    stream, result["how"] = ctx.Stream(), "green context"
                else:
                    stream, result["how"] = torch.cuda.Stream(), "whole GPU"
                fns = codec_setup(stream)
                for mode, fn in fns.items():
                    result[f"codec {mode} alone ms"] = median_ms(fn, 10)
                ready.set()
                while not stop.is_set():
                    mode = mode_box["mode"]
                    if mode is None:
                        time.sleep(0.001)
                        continue
                    t0 = time.perf_counter()
                    fns[mode]()
                    result.setdefault(f"codec {mode} beside ms", []).append((time.perf_counter() - t0) * 1e3)
            except Exception as exc:  # reported in the row, the next setting still runs
                result["error"] = f"{type(exc).__name__}: {exc}"
                ready.set()

        thread = threading.Thread(target=codec_thread)
        thread.start()
        ready.wait()
        row = {"codec_sms": sms or sms_total}
        if "error" not in result:
            for mode in ("eager", "graph"):
                mode_box["mode"] = mode
                time.sleep(0.2)
                row[f"talker beside codec {mode} ms"] = median_ms(talker_step, 30)
                mode_box["mode"] = None
                time.sleep(0.1)
        stop.set()
        thread.join()
        for key, value in result.items():
            row[key] = round(statistics.median(value), 2) if isinstance(value, list) else value
        out["rows"].append(row)
        print(row, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
