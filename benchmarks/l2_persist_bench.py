"""Does an L2 persisting window make re-read weights cheaper? A frame's look-alike, GPU only.

A frame reads the code predictor's 5 layers (~155 MB for 0.6B) 15 times and the talker's (~0.9 GB) once; the
H100's L2 (50 MB) keeps none of the former from one pass to the next, since everything streams through it. CUDA
lets a process set part of L2 aside for accesses marked persisting (an access policy window: an address range and
the share of its lines to keep). This times a synthetic frame (15 passes of 5 products over `hot` weights, plus one
product over each of 28 `cold` weights) at 1 and 32 rows, eager and as a CUDA graph, without a window and with one
over the hot weights, set (a) on the capturing stream and (b) on each kernel node of the captured graph, so that it
also says whether a graph keeps the stream's window.

    python benchmarks/l2_persist_bench.py [--hot-mb 31,155] [--rows 1,32] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics

import torch

_ACCESS_POLICY_WINDOW = 1  # cudaStreamAttributeAccessPolicyWindow = cudaKernelNodeAttributeAccessPolicyWindow
_LIMIT_PERSISTING_L2 = 0x06  # cudaLimitPersistingL2CacheSize
_ATTR_MAX_PERSISTING_L2 = 108  # cudaDevAttrMaxPersistingL2CacheSize
_ATTR_MAX_WINDOW = 109  # cudaDevAttrMaxAccessPolicyWindowSize
_PERSISTING, _STREAMING, _NORMAL = 2, 1, 0
_KERNEL_NODE = 0  # cudaGraphNodeTypeKernel


def cudart() -> ctypes.CDLL:
    """The CUDA runtime that torch loaded (its path from the process's maps)."""
    torch.cuda.init()
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcudart" in line}
    if not paths:
        raise SystemExit("no libcudart in this process")
    return ctypes.CDLL(sorted(paths)[0])


class Window(ctypes.Structure):
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hitRatio", ctypes.c_float),
                ("hitProp", ctypes.c_int), ("missProp", ctypes.c_int)]


class AttrValue(ctypes.Union):  # cudaLaunchAttributeValue: 64 bytes
    _fields_ = [("window", Window), ("pad", ctypes.c_char * 64)]


def check(rt, code: int, what: str) -> None:
    if code:
        rt.cudaGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"{what}: CUDA error {code} ({rt.cudaGetErrorString(code).decode()})")


def device_attr(rt, attr: int) -> int:
    value = ctypes.c_int()
    check(rt, rt.cudaDeviceGetAttribute(ctypes.byref(value), attr, torch.cuda.current_device()), "attribute")
    return value.value


def window_value(tensor: torch.Tensor | None, persisting: int, largest: int) -> AttrValue:
    """A window over the tensor's first `largest` bytes (the device's limit), of which the share that
    `persisting` bytes of L2 can hold persists; None: no window."""
    v = AttrValue()
    if tensor is not None:
        nbytes = min(tensor.numel() * tensor.element_size(), largest)
        v.window = Window(tensor.data_ptr(), nbytes, min(1.0, persisting / nbytes), _PERSISTING, _STREAMING)
    return v


def set_stream_window(rt, stream: torch.cuda.Stream, value: AttrValue) -> None:
    check(rt, rt.cudaStreamSetAttribute(ctypes.c_void_p(stream.cuda_stream), _ACCESS_POLICY_WINDOW,
                                        ctypes.byref(value)), "cudaStreamSetAttribute")


def set_graph_window(rt, graph: torch.cuda.CUDAGraph, value: AttrValue) -> int:
    """Set the window on every kernel node of a captured (kept, not yet instantiated) graph; returns the count."""
    handle = ctypes.c_void_p(graph.raw_cuda_graph())
    count = ctypes.c_size_t()
    check(rt, rt.cudaGraphGetNodes(handle, None, ctypes.byref(count)), "cudaGraphGetNodes")
    nodes = (ctypes.c_void_p * count.value)()
    check(rt, rt.cudaGraphGetNodes(handle, nodes, ctypes.byref(count)), "cudaGraphGetNodes")
    kernels = 0
    for node in nodes:
        kind = ctypes.c_int()
        check(rt, rt.cudaGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cudaGraphNodeGetType")
        if kind.value == _KERNEL_NODE:
            check(rt, rt.cudaGraphKernelNodeSetAttribute(ctypes.c_void_p(node), _ACCESS_POLICY_WINDOW,
                                                         ctypes.byref(value)), "cudaGraphKernelNodeSetAttribute")
            kernels += 1
    return kernels


def frame(x: torch.Tensor, hot: torch.Tensor, cold: torch.Tensor, outs: tuple[torch.Tensor, torch.Tensor]) -> None:
    """15 passes over the hot weights' 5 matrices, then one product with each cold matrix."""
    for _ in range(15):
        for w in hot:
            torch.matmul(x, w.t(), out=outs[0])
    for w in cold:
        torch.matmul(x, w.t(), out=outs[1])


def timed(fn, reps: int = 20) -> float:
    """Median ms of `fn` over reps, after 3 warm runs."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hot-mb", default="31,62,124", help="the re-read weights' size (5 equal matrices)")
    ap.add_argument("--rows", default="1,32")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("l2_persist_bench needs a CUDA device")
    rt = cudart()
    persist_max, window_max = device_attr(rt, _ATTR_MAX_PERSISTING_L2), device_attr(rt, _ATTR_MAX_WINDOW)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}: L2 {l2 / 2**20:.0f} MiB, persisting at most "
          f"{persist_max / 2**20:.1f} MiB, window at most {window_max / 2**20:.1f} MiB", flush=True)
    check(rt, rt.cudaDeviceSetLimit(_LIMIT_PERSISTING_L2, ctypes.c_size_t(persist_max)), "cudaDeviceSetLimit")
    k = 1024
    cold = torch.randn(28, 16 * 1024, k, device="cuda", dtype=torch.bfloat16)  # 28 x 32 MiB
    results = []
    print("| hot MiB | rows | window | eager ms | graph ms | graph, stream window ms | graph, node window ms | nodes |")
    print("|---|---|---|---|---|---|---|---|")
    for hot_mb in (float(v) for v in args.hot_mb.split(",")):
        n = int(hot_mb * 2**20 / 5 / k / 2) // 64 * 64
        hot = torch.randn(5, n, k, device="cuda", dtype=torch.bfloat16)
        hit = min(1.0, persist_max / min(hot.numel() * 2, window_max))
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            outs = (torch.empty(rows, n, device="cuda", dtype=torch.bfloat16),
                    torch.empty(rows, cold.shape[1], device="cuda", dtype=torch.bfloat16))

            def run() -> None:
                frame(x, hot, cold, outs)

            row = {"hot_mb": hot_mb, "rows": rows, "hit_ratio": round(hit, 3)}
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                row["eager_ms"] = timed(run)
                set_stream_window(rt, stream, window_value(hot, persist_max, window_max))
                row["eager_window_ms"] = timed(run)
                set_stream_window(rt, stream, window_value(None, 0, 0))
            check(rt, rt.cudaCtxResetPersistingL2Cache(), "reset")
            plain, on_stream = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(plain, stream=stream):
                run()
            set_stream_window(rt, stream, window_value(hot, persist_max, window_max))
            with torch.cuda.graph(on_stream, stream=stream):
                run()
            set_stream_window(rt, stream, window_value(None, 0, 0))
            nodes = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(nodes, stream=stream):
                run()
            row["kernel_nodes"] = set_graph_window(rt, nodes, window_value(hot, persist_max, window_max))
            nodes.instantiate()
            for name, g in (("graph_ms", plain), ("graph_stream_window_ms", on_stream), ("graph_node_window_ms", nodes)):
                check(rt, rt.cudaCtxResetPersistingL2Cache(), "reset")
                row[name] = timed(g.replay)
            row["graph_again_ms"] = timed(plain.replay)
            results.append(row)
            print(f"| {hot_mb:.0f} | {rows} | {hit:.2f} | {row['eager_ms']:.3f} / window {row['eager_window_ms']:.3f} | "
                  f"{row['graph_ms']:.3f} (again {row['graph_again_ms']:.3f}) | {row['graph_stream_window_ms']:.3f} | "
                  f"{row['graph_node_window_ms']:.3f} | {row['kernel_nodes']} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "l2_bytes": l2,
                       "persisting_max_bytes": persist_max, "window_max_bytes": window_max, "rows": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
