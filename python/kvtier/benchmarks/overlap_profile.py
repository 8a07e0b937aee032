"""Where does a concurrent load slow the compute down? A CUPTI trace (torch.profiler) of the overlap bench's
compute loop, replayed as one CUDA graph, alone and beside a LayerLoader load of geometry A (256 pages),
per backend: matmul kernel durations (slower kernels = contention on the device) against gaps between them on
the compute stream (= kernels started late), and the copies' or transfer kernels' span.

    python -m kvtier.benchmarks.overlap_profile [--out DIR]

Prints one JSON line per (backend, scenario) and writes ``overlap_profile.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from kvtier import LayerLoader

from .transfer import GEOMS, event_time
from .transfer_probe import _pools


def _summary(trace: dict, compute_stream: int) -> dict:
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kern = sorted((e for e in evs if e.get("cat") == "kernel" and e.get("args", {}).get("stream") == compute_stream),
                  key=lambda e: e["ts"])
    other = [e for e in evs if e.get("cat") in ("kernel", "gpu_memcpy") and e.get("args", {}).get("stream") != compute_stream]
    out = {}
    if kern:
        busy = sum(e["dur"] for e in kern)
        span = kern[-1]["ts"] + kern[-1]["dur"] - kern[0]["ts"]
        out.update(compute_kernels=len(kern), kernel_median_us=round(statistics.median(e["dur"] for e in kern), 2),
                   compute_busy_ms=round(busy / 1e3, 3), compute_span_ms=round(span / 1e3, 3),
                   compute_gaps_ms=round((span - busy) / 1e3, 3))
    if other:
        start = min(e["ts"] for e in other)
        end = max(e["ts"] + e["dur"] for e in other)
        out.update(transfer_ops=len(other), transfer_span_ms=round((end - start) / 1e3, 3),
                   transfer_kinds=sorted({e.get("cat") for e in other}))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m kvtier.benchmarks.overlap_profile")
    ap.add_argument("--out", default="benches/results")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    g = GEOMS["A"]
    L = g["layers"]
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    results = []
    for layout, backend in (("page_first_direct", "direct"), ("page_first", "kernel")):
        dp, hp, h, d = _pools(g, 256, layout)
        loader = LayerLoader(hp, dp, backend)
        t_xfer = event_time(lambda: loader.load(h, d).synchronize(), 3)
        k = max(1, round(t_xfer / L / event_time(lambda: a @ a, 5)))
        graph = torch.cuda.CUDAGraph()
        cap = torch.cuda.Stream()
        cap.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(cap):
            for _ in range(L * k):
                a @ a
            with torch.cuda.graph(graph, stream=cap):
                for _ in range(L * k):
                    a @ a
        torch.cuda.current_stream().wait_stream(cap)
        stream_id = None
        for scenario in ("compute alone", "compute beside a load"):
            for _ in range(2):  # warm-up
                ld = loader.load(h, d) if scenario != "compute alone" else None
                graph.replay()
                if ld is not None:
                    ld.synchronize()
                torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                ld = loader.load(h, d) if scenario != "compute alone" else None
                graph.replay()
                if ld is not None:
                    ld.synchronize()
                torch.cuda.synchronize()
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                prof.export_chrome_trace(f.name)
                trace = json.load(open(f.name))
            if stream_id is None:  # the graph's kernels run on the stream with the most kernels
                counts: dict = {}
                for e in trace.get("traceEvents", []):
                    if e.get("cat") == "kernel":
                        s = e.get("args", {}).get("stream")
                        counts[s] = counts.get(s, 0) + 1
                stream_id = max(counts, key=counts.get)
            row = {"backend": backend, "scenario": scenario, "matmuls": L * k, **_summary(trace, stream_id)}
            results.append(row)
            print(json.dumps(row), flush=True)
        hp.close()
        del dp
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "overlap_profile.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
