"""What building a request body costs the client's event loop, by task and clone mode (ms a body).

    python benchmarks/request_build_bench.py [--set long] [--bodies 300] [--json OUT.json]

`ttsbench run` builds each body when it sends it (a clone body carries its ~0.3 MB reference clip, so bodies are
not built up front); a closed-loop level's first wave builds one per stream at once, on the loop that also reads
every stream's audio. This builds --bodies bodies of the built-in --set for each task and mode, as the runner does,
and prints the mean ms a body and its size.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ttsbench import datasets
from ttsbench.requests import RequestBuilder, RequestOptions

CASES = (("custom", "inline"), ("design", "inline"), ("clone", "inline"), ("clone", "upload"), ("clone", "fresh"))


def build_cost(task: str, clone_mode: str, items: list, bodies: int) -> dict:
    builder = RequestBuilder(task, RequestOptions(clone_mode=clone_mode))
    size = len(builder.build(items[0], 0).body)  # the first build also reads and encodes the clip once
    t0 = time.perf_counter()
    for i in range(bodies):
        builder.build(items[i % len(items)], i)
    return {"task": task, "clone_mode": clone_mode, "ms": (time.perf_counter() - t0) / bodies * 1e3, "bytes": size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", default="long")
    ap.add_argument("--bodies", type=int, default=300)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    items = datasets.load_set(args.set)
    rows = [build_cost(task, mode, items, args.bodies) for task, mode in CASES]
    print(f"| task | clone mode | ms a body ({args.set} set, mean of {args.bodies}) | body bytes |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['task']} | {r['clone_mode'] if r['task'] == 'clone' else '-'} | {r['ms']:.3f} | {r['bytes']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
