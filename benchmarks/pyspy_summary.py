"""Where a served level's host time went, per thread, from a py-spy profile of the server.

    python benchmarks/pyspy_summary.py PROFILE.txt [--under FUNC ...] [--depth 2] [--top 8]

PROFILE is py-spy's raw (collapsed) output of `py-spy record --threads --idle --format raw` (gpu_bench.sh writes one
per level with PYSPY=SECONDS): one line per distinct stack, "thread (tid): name;frame;...;frame count". Prints, per
thread, its samples, the active ones (not parked in a wait: an event loop's select, a pool worker's queue, a
thread's join), its share of the time on the interpreter (active, less our sleeps on a CUDA event), and how the
active samples split over the first frame of our own code (serving/, ttsbench/, benchmarks/) below the thread's loop
(an event loop's turn, a pool worker's item; named, not inferred: py-spy cuts some stacks short); the threads'
shares summed; then, for each --under function, how its samples split over the frames below it. Session 28 found
this way that the codec thread spent three quarters of its time in a copy to the host that was meant to be
asynchronous; session 44, that at 128 streams the server's threads want more than its one interpreter
(docs/performance.md).

Caveat: a thread waiting to take the interpreter lock back after a C call shows the frame it waits in, so a parked
frame (select, a queue's get) counts as idle even when the thread is in fact waiting for the lock, and a C call that
let go of it (numpy's loops, a socket's write) counts as on the interpreter: the shares are an upper bound on the
lock's use, and a sum above 1 says that threads waited for it.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from pathlib import Path

# Leaf frames of a thread parked until something happens (the calls below them are C, with the lock released);
# _recv_msg and Timer.check are torch's compile workers' pipe read and timer
PARKED = ("EpollSelector.select", "_worker", "Thread._wait_for_tstate_lock", "Condition.wait", "Event.wait",
          "Popen._wait", "Queue.get", "_recv_msg", "Timer.check")
# Our polling wait on a CUDA event (serving/engine/cuda_graphs.py): active, but asleep with the lock released
SLEEPING = ("sleep_until",)
LOOPS = ("BaseEventLoop._run_once", "_WorkItem.run")
OURS = re.compile(r"\((?:serving|ttsbench|benchmarks)/")
_THREAD = re.compile(r"^thread \((\d+)\)(?:: (.*))?$")


def parse(text: str) -> list[tuple[str, list[str], int]]:
    """(thread name, frames outermost first, samples) per line; lines of other shapes are skipped."""
    out = []
    for line in text.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        head, *frames = stack.split(";")
        m = _THREAD.match(head)
        if m is None:
            continue
        out.append((m.group(2) or m.group(1), frames, int(count)))
    return out


def name(frame: str) -> str:
    """A frame's function, without its file and line."""
    return frame.split(" (", 1)[0]


def parked(frames: list[str]) -> bool:
    return not frames or name(frames[-1]) in PARKED


def below_loop(frames: list[str]) -> list[str]:
    """The frames below the innermost loop frame (LOOPS), or all of them where there is none."""
    names = [name(f) for f in frames]
    inner = max((i for i, n in enumerate(names) if n in LOOPS), default=-1)
    return frames[inner + 1:]


def by_thread(stacks, top: int = 8) -> list[dict]:
    """Per thread (most active first): samples, active samples, its share of the profile's time on the interpreter
    (active and not asleep in SLEEPING) and the active samples by the first frame of ours below its loop ("(not ours:
    leaf)" where there is none). The threads' shares summed say how busy the one interpreter they share was:
    above 1, threads queued for its lock (session 44: ~1.2-1.3 at 128 streams of short text)."""
    total, active, asleep, where = Counter(), Counter(), Counter(), defaultdict(Counter)
    for thread, frames, n in stacks:
        total[thread] += n
        if parked(frames):
            continue
        active[thread] += n
        if any(name(f) in SLEEPING for f in frames):
            asleep[thread] += n
        ours = next((f for f in below_loop(frames) if OURS.search(f)), None)
        where[thread][name(ours) if ours else f"(not ours: {name(frames[-1])})"] += n
    span = max(total.values(), default=1)  # the profile's samples: py-spy --idle samples every live thread
    return [{"thread": t, "samples": total[t], "active": active[t],
             "interpreter": (active[t] - asleep[t]) / span, "where": where[t].most_common(top)}
            for t in sorted(total, key=lambda t: (-active[t], t))]


def under(stacks, function: str, depth: int = 2, top: int = 8) -> tuple[int, list[tuple[str, int]]]:
    """Samples with `function` on the stack, and how they split over the `depth` frames below its outermost call
    ("(itself)" where it is the leaf)."""
    split, count = Counter(), 0
    for _, frames, n in stacks:
        names = [name(f) for f in frames]
        if function not in names:
            continue
        count += n
        i = names.index(function)
        below = frames[i + 1:i + 1 + depth]
        split[" > ".join(below) if below else "(itself)"] += n
    return count, split.most_common(top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile", type=Path)
    ap.add_argument("--under", action="append", default=[], help="a function (Class.method) to break down")
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    stacks = parse(args.profile.read_text())
    if not stacks:
        raise SystemExit(f"{args.profile}: no py-spy raw stacks in it")
    rows = by_thread(stacks, args.top)
    print("| thread | samples | active | on the interpreter | active samples by first frame of ours below the thread's "
          "loop |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['thread']} | {row['samples']} | {row['active']} | {row['interpreter']:.2f} | "
              + ", ".join(f"{k} {v}" for k, v in row["where"]) + " |")
    print(f"\nOn the interpreter, all threads: {sum(row['interpreter'] for row in rows):.2f} of the profile's time "
          "(above 1: threads queued for its lock)")
    for function in args.under:
        count, split = under(stacks, function, args.depth, args.top)
        print(f"\n{function}: {count} samples")
        for frames, n in split:
            print(f"  {n:6d}  {frames}")


if __name__ == "__main__":
    main()
