"""Does a CUDA graph's replay go first beside other work, by the priority of its capture or of its replay stream?

The talker's frame is ~1,000 small dependent kernels replayed as one CUDA graph while the codec's large
convolutions run on another stream. PyTorch instantiates graphs with cudaGraphInstantiateFlagUseNodePriority, so
a replayed kernel should keep the priority of the stream it was captured on. This checks that on the GPU with
stand-ins (no checkpoint): a graph of small products (the frame) captured on a stream of priority 0 or of the
most urgent priority, replayed on a stream of either priority, timed alone and while a queue of large kernels
(the codec) runs on a priority-0 stream: cuBLAS products (persistent kernels: a program per SM for the whole
kernel) or elementwise passes (many short programs, as the codec's Triton kernels launch); CUDA-event medians in
ms. Priority only picks which waiting program an SM takes next; it never preempts a running one.

    python benchmarks/graph_priority.py [--small 300] [--rows 32] [--big 8192] [--queue 40]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from graph_timing import captured_on


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", type=int, default=300, help="dependent small products in the graph")
    ap.add_argument("--rows", type=int, default=32, help="rows of each small product (x [rows, 1024] @ w)")
    ap.add_argument("--big", type=int, default=8192, help="side of each large product in the background queue")
    ap.add_argument("--queue", type=int, default=40, help="large products queued behind each timed replay")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    dev = torch.device("cuda")
    urgent = torch.cuda.Stream.priority_range()[1]
    print(f"device {torch.cuda.get_device_name()}; torch {torch.__version__}; priorities {urgent}..0")
    w = torch.randn(1024, 1024, dtype=torch.bfloat16, device=dev) / 32
    x = torch.randn(args.rows, 1024, dtype=torch.bfloat16, device=dev)
    a = torch.randn(args.big, args.big, dtype=torch.bfloat16, device=dev)
    c = torch.randn(8 * args.big * args.big, dtype=torch.bfloat16, device=dev)
    d = torch.empty_like(c)
    kinds = {"cuBLAS products": lambda: a @ a, "elementwise passes": lambda: torch.sin(c, out=d)}
    background = torch.cuda.Stream(dev, priority=0)

    def frame():
        h = x
        for _ in range(args.small):
            h = torch.tanh(h @ w)
        return h

    graphs = {captured: captured_on(torch.cuda.Stream(dev, priority=captured), frame) for captured in (0, urgent)}

    def timed(graph, replay_priority: int, beside=None) -> float:
        stream = torch.cuda.Stream(dev, priority=replay_priority)
        times = []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            if beside is not None:
                with torch.cuda.stream(background):
                    for _ in range(args.queue):
                        beside()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record()
                graph.replay()
                end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        torch.cuda.synchronize()
        return statistics.median(times)

    for name, kernel in kinds.items():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(background):
            kernel()
            start.record()
            kernel()
            end.record()
        torch.cuda.synchronize()
        print(f"one of the {name}: {start.elapsed_time(end):.2f} ms; {args.queue} queued behind each timed replay")
    print("\n| graph captured at priority | replayed at priority | alone ms | "
          + " | ".join(f"beside {name} ms" for name in kinds) + " |")
    print("|---|---|---|" + "---|" * len(kinds))
    for captured, graph in graphs.items():
        for replayed in (0, urgent):
            cells = [timed(graph, replayed)] + [timed(graph, replayed, kernel) for kernel in kinds.values()]
            print(f"| {captured} | {replayed} | " + " | ".join(f"{c:.2f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
