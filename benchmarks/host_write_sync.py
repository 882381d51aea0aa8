"""Which small host-side writes into device tensors wait for the kernels already queued on their stream.

    python3 benchmarks/host_write_sync.py [--sleep-ms 20] [--json OUT]

The engine's loop frees a finished request's slot (TalkerRunner.release: two per-slot writes on the talker's
stream) while the next decode step is in flight; a write that waits for the stream holds the loop, and with it the
codec's next call and the handing out of frames, until that step is done. Each write here runs on a side stream
right after a kernel that keeps that stream busy for --sleep-ms, and its host time is printed: ~0 for a write that
only queues a kernel, ~--sleep-ms for one that waits.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def writes(t: torch.Tensor, idx: torch.Tensor) -> dict:
    """name -> the write, each the form some engine code uses or could use."""
    return {
        "t[i] = 0": lambda: t.__setitem__(5, 0),
        "t[i].zero_()": lambda: t[5].zero_(),
        "t[i:i+1].fill_(0)": lambda: t[5:6].fill_(0),
        "t[idx] = 1 (index tensor)": lambda: t.__setitem__(idx, 1),
        "t[idx] = pinned upload":
            lambda: t.__setitem__(idx, torch.tensor([7, 8], pin_memory=True).to(t.device, non_blocking=True)),
        "t[idx] = pageable tensor": lambda: t.__setitem__(idx, torch.tensor([7, 8]).to(t.device)),
        "t.fill_(0) (whole)": lambda: t.fill_(0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sleep-ms", type=float, default=20.0, help="how long the queued kernel keeps the stream busy")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device: on a CPU every write is synchronous and there is no stream to wait for")
    device = torch.device("cuda")
    stream = torch.cuda.Stream(device)
    t = torch.zeros(128, dtype=torch.int64, device=device)
    idx = torch.tensor([3, 9], device=device)
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000)  # the first launch loads the kernel: kept out of the calibration below
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # cycles per ms
    start.record(); torch.cuda._sleep(10_000_000); end.record(); end.synchronize()
    cycles = int(10_000_000 * args.sleep_ms / start.elapsed_time(end))
    rows = []
    print(f"| write (on a stream busy for {args.sleep_ms:g} ms) | host ms, each of {args.repeats} |\n|---|---|")
    for name, write in writes(t, idx).items():
        times = []
        for _ in range(args.repeats + 1):  # the first is a warm-up (allocations, kernel loading)
            with torch.cuda.stream(stream):
                torch.cuda._sleep(cycles)
                t0 = time.perf_counter()
                write()
                times.append(1000 * (time.perf_counter() - t0))
            stream.synchronize()
        rows.append({"write": name, "host_ms": [round(x, 3) for x in times[1:]]})
        print(f"| `{name}` | {' / '.join(f'{x:.3f}' for x in times[1:])} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sleep_ms": args.sleep_ms, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
