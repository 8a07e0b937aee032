"""Where does a concurrent load slow the compute down? A CUPTI trace (torch.profiler) of the overlap bench's
compute loop, replayed as one CUDA graph, alone and beside a LayerLoader load of geometry A (256 pages),
per backend: matmul kernel durations (slower kernels = contention on the device) against gaps between them on
the compute stream (= kernels started late), and the copies' or transfer kernels' span. Then the bench's eager
loop (k small matmuls per layer launched from Python after ``wait(layer)``), alone and with a load, with the host
side traced too: how long each kernel-launch API call took (driver contention shows as slower launches) and
how long the load's copy-submission calls held the driver.

    python -m kvtier_bench.overlap_profile [--out DIR]

Prints one JSON line per (backend, scenario) and writes ``overlap_profile.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvtier import LayerLoader

from .transfer import GEOMS, event_time
from .transfer_probe import make_pools


def _summary(trace: dict, compute_stream: int) -> dict:
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kern = sorted((e for e in evs if e.get("cat") == "kernel" and e.get("args", {}).get("stream") == compute_stream),
                  key=lambda e: e["ts"])
    other = [e for e in evs if e.get("cat") in ("kernel", "gpu_memcpy") and e.get("args", {}).get("stream") != compute_stream]
    out: dict = {}
    if kern:
        busy = sum(e["dur"] for e in kern)
        span = kern[-1]["ts"] + kern[-1]["dur"] - kern[0]["ts"]
        out.update(compute_kernels=len(kern), kernel_median_us=round(statistics.median(e["dur"] for e in kern), 2),
                   compute_busy_ms=round(busy / 1e3, 3), compute_span_ms=round(span / 1e3, 3),
                   compute_gaps_ms=round((span - busy) / 1e3, 3))
    launches = [e["dur"] for e in evs if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "LaunchKernel" in str(e.get("name", ""))]
    if launches:
        launches.sort()
        out.update(launch_calls=len(launches), launch_median_us=round(statistics.median(launches), 2),
                   launch_p90_us=round(launches[int(0.9 * (len(launches) - 1))], 2),
                   launch_total_ms=round(sum(launches) / 1e3, 3))
    copies = [e["dur"] for e in evs if e.get("cat") in ("cuda_runtime", "cuda_driver") and "Memcpy" in str(e.get("name", ""))]
    if copies:
        out.update(copy_api_calls=len(copies), copy_api_total_ms=round(sum(copies) / 1e3, 3))
    if other:
        start = min(e["ts"] for e in other)
        end = max(e["ts"] + e["dur"] for e in other)
        out.update(transfer_ops=len(other), transfer_span_ms=round((end - start) / 1e3, 3),
                   transfer_kinds=sorted({e.get("cat") for e in other}))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m kvtier_bench.overlap_profile")
    ap.add_argument("--out", default="benches/results")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    g = GEOMS["A"]
    L = g["layers"]
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    results = []
    for layout, backend in (("page_first_direct", "direct"), ("page_first", "kernel")):
        dp, hp, h, d = make_pools(g, 256, layout)
        loader = LayerLoader(hp, dp, backend)
        t_xfer = event_time(lambda: loader.load(h, d).synchronize(), 3)
        # one matmul's device time from 64 back to back (as the transfer bench calibrates)
        k = max(1, round(t_xfer / L / (event_time(lambda: [a @ a for _ in range(64)], 5) / 64)))
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

        def eager(with_load: bool) -> None:
            # the transfer bench's eager overlap loop: k small matmuls per layer after waiting for the layer
            ld = loader.load(h, d) if with_load else None
            for layer in range(L):
                if ld is not None:
                    ld.wait(layer)
                for _ in range(k):
                    a @ a
            if ld is not None:
                ld.synchronize()

        def graphed(with_load: bool) -> None:
            ld = loader.load(h, d) if with_load else None
            graph.replay()
            if ld is not None:
                ld.synchronize()

        scenarios = {"compute alone": lambda: graphed(False), "compute beside a load": lambda: graphed(True),
                     "eager compute alone": lambda: eager(False),
                     "eager compute with LayerLoader waits": lambda: eager(True)}
        for scenario, fn in scenarios.items():
            eager_run = scenario.startswith("eager")
            for _ in range(2):  # warm-up
                fn()
                torch.cuda.synchronize()
            walls = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                walls.append(time.perf_counter() - t0)
            wall = statistics.median(walls)
            acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if eager_run else [])
            with profile(activities=acts) as prof:
                fn()
                torch.cuda.synchronize()
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                prof.export_chrome_trace(f.name)
                trace = json.load(open(f.name))
            # the compute runs on the stream with the most kernels (48·k against the load's 96 at most)
            counts: dict = {}
            for e in trace.get("traceEvents", []):
                if e.get("cat") == "kernel":
                    sid = e.get("args", {}).get("stream")
                    counts[sid] = counts.get(sid, 0) + 1
            stream_id = max(counts, key=counts.get)
            row = {"backend": backend, "scenario": scenario, "matmuls": L * k, "wall_ms_unprofiled": round(wall * 1e3, 3),
                   **_summary(trace, stream_id)}
            results.append(row)
            print(json.dumps(row), flush=True)
        hp.close()
        del dp
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "overlap_profile.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
