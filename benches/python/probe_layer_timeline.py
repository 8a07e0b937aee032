"""Where a small per-layer load's device time goes, from the GPU's own timeline: a CUPTI trace
(``torch.profiler``) of one pass of per-layer calls (``load_to_device_per_layer``, one call per layer) and of
one ``LayerLoader`` load (every layer in one call), for the given geometries, backends and page counts, the
caller on a side stream with CPU index tensors.

From the trace's transfer kernels and copies (every kernel the load launches, Triton's or the copy engine's,
recorded by CUPTI whatever API launched it), per cell:

- ``span_us_per_layer``: the load's first start to its last end, per layer;
- ``busy_us_per_layer``: the union of the transfer's kernel and copy intervals, per layer (time the GPU moved
  this load's bytes), and ``idle_us_per_layer`` = span − busy (time nothing of the load ran: launch gaps, the
  join of the two lanes, event waits);
- per stream, the median duration of one kernel or copy and how many ran (K runs on the caller's stream and V
  on the side lane when the kernel route spreads them over two lanes);
- ``floor_us_per_layer``: the layer's bytes at the ceiling measured in the same run (a pinned 2 GiB copy);
- ``loader_host``: the host side of a LayerLoader load with the GPU held busy (a ``torch.cuda._sleep`` ahead
  on the stream, so nothing waits on the device): its median µs, and cProfile's top functions by cumulative
  and by own time over ``HOST_LOADS`` loads;
- ``loader_us_per_layer`` (no profiler: events around each load, median of 5) as the pool is, and
  ``loader_us_per_layer_versioned`` with the device pool declaring ``layers_version`` (the promise kvtier's own
  layer windows make, which turns the check of every layer tensor before a load into one comparison).

    PYTHONPATH=python python benches/python/probe_layer_timeline.py --out probe-layer-timeline.json
        [--geoms A,C] [--pages 16,64] [--backends direct,kernel]

Prints a JSON line per cell and a table at the end. Needs a CUDA GPU."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

import kvtier
from kvtier import LayerLoader
from kvtier_bench.transfer import (GEOMS, PS, ceiling, check_exact, event_time, make_device_pool, page_idx,
                                       page_layer_bytes)

LAYOUTS = {"direct": "page_first_direct", "kernel": "page_first"}
HOST_LOADS = 20
BUSY_CYCLES = 200_000_000  # ~100 ms of GPU time ahead of the timed loads


def loader_host(loader, h, d) -> dict:
    """Host time of LayerLoader loads issued while the GPU is busy, plain (median µs) and under cProfile."""
    import cProfile
    import io
    import pstats

    loads, plain = [], []
    torch.cuda._sleep(BUSY_CYCLES)
    for _ in range(HOST_LOADS):
        t = time.perf_counter_ns()
        loads.append(loader.load(h, d))
        plain.append((time.perf_counter_ns() - t) / 1e3)
    busy = not torch.cuda.current_stream().query()
    for ld in loads:
        ld.synchronize()
    pr = cProfile.Profile()
    torch.cuda._sleep(BUSY_CYCLES)
    pr.enable()
    loads = [loader.load(h, d) for _ in range(HOST_LOADS)]
    pr.disable()
    for ld in loads:
        ld.synchronize()
    out = {"median_us_per_load": round(statistics.median(plain), 1), "gpu_busy_throughout": busy}
    for order in ("cumulative", "tottime"):
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats(order).print_stats(25)
        out[f"profile_{order}"] = buf.getvalue()
    return out


def trace(fn) -> list[dict]:
    """The kernels and copies that ran on the GPU during ``fn`` (after it synchronized), sorted by start."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as r:
            events = json.load(r).get("traceEvents", [])
    out = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy") and "dur" in e]
    return sorted(out, key=lambda e: e["ts"])


def timeline(events: list[dict], layers: int) -> dict:
    """Span, busy (union of intervals) and idle per layer, and per stream the median duration and count."""
    if not events:
        return {"events": 0}
    span = max(e["ts"] + e["dur"] for e in events) - events[0]["ts"]
    busy, end = 0.0, None
    for e in events:
        a, b = e["ts"], e["ts"] + e["dur"]
        if end is None or a >= end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    streams: dict[str, list[float]] = {}
    for e in events:
        streams.setdefault(str(e.get("args", {}).get("stream", "?")), []).append(e["dur"])
    return {"events": len(events), "span_us_per_layer": round(span / layers, 2),
            "busy_us_per_layer": round(busy / layers, 2), "idle_us_per_layer": round((span - busy) / layers, 2),
            "per_stream": {s: {"count": len(d), "median_us": round(statistics.median(d), 2)} for s, d in streams.items()},
            "names": sorted({e["name"][:60] for e in events})}


def cell(g: dict, name: str, backend: str, pages: int, side, up: float) -> dict:
    dp = make_device_pool(g, (pages + 8) * PS)
    for ts in ((dp.kv_buffer,) if hasattr(dp, "kv_buffer") else (dp.k_buffer, dp.v_buffer)):
        for t in ts:
            t.view(torch.uint8).random_(0, 256)
    hp = kvtier.host_pool_for(dp, layout=LAYOUTS[backend], host_to_device_ratio=1.0)
    h = page_idx(torch.randperm(hp.page_num)[:pages])
    d = page_idx(torch.randperm(pages + 7)[:pages] + 1)
    L = hp.layer_num
    loader = LayerLoader(hp, dp, backend, stream=side)
    with torch.cuda.stream(side):
        hp.backup_from_device_all_layer(dp, h, d, backend)
        for _ in range(3):  # warm: plans, launches, Triton's compile
            for layer in range(L):
                hp.load_to_device_per_layer(dp, h, d, layer, backend)
            loader.load(h, d).synchronize()
        torch.cuda.synchronize()
        per_layer = timeline(trace(lambda: [hp.load_to_device_per_layer(dp, h, d, layer, backend)
                                            for layer in range(L)]), L)
        whole = timeline(trace(lambda: loader.load(h, d).synchronize()), L)
        exact = check_exact(hp, dp, h, d)
        host = loader_host(loader, h, d)
        torch.cuda.synchronize()
        plain = event_time(lambda: loader.load(h, d).synchronize(), 5) / L
        dp.layers_version = 1  # this probe's pool never changes its layer tensors
        versioned = event_time(lambda: loader.load(h, d).synchronize(), 5) / L
        host_versioned = loader_host(loader, h, d)["median_us_per_load"]
        exact = exact and check_exact(hp, dp, h, d)
    hp.close()
    nbytes = pages * page_layer_bytes(g)
    return {"geometry": name, "backend": backend, "pages": pages, "stream": "side", "indices": "cpu",
            "bytes_per_layer": nbytes, "floor_us_per_layer": round(nbytes / up / 1e3, 2), "bit_exact": bool(exact),
            "per_layer_calls": per_layer, "layer_loader": whole, "loader_host": host,
            "loader_us_per_layer": round(plain * 1e6, 2), "loader_us_per_layer_versioned": round(versioned * 1e6, 2),
            "loader_host_us_per_load_versioned": host_versioned}


def table(rows: list) -> str:
    out = ["| geom | backend | pages | floor µs | per-layer calls: span / busy / idle µs per layer | "
           "LayerLoader: span / busy / idle | exact |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        p, w = r["per_layer_calls"], r["layer_loader"]
        out.append(f"| {r['geometry']} | {r['backend']} | {r['pages']} | {r['floor_us_per_layer']} | "
                   f"{p.get('span_us_per_layer')} / {p.get('busy_us_per_layer')} / {p.get('idle_us_per_layer')} | "
                   f"{w.get('span_us_per_layer')} / {w.get('busy_us_per_layer')} / {w.get('idle_us_per_layer')} | "
                   f"{r['bit_exact']} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument("--geoms", default="A,C")
    ap.add_argument("--pages", default="16,64")
    ap.add_argument("--backends", default="direct,kernel")
    args = ap.parse_args()
    geoms = [x for x in args.geoms.split(",") if x]
    if any(x not in GEOMS for x in geoms):
        ap.error(f"--geoms: choose from {sorted(GEOMS)}")
    backends = [x for x in args.backends.split(",") if x]
    if any(b not in LAYOUTS for b in backends):
        ap.error(f"--backends: choose from {sorted(LAYOUTS)}")
    try:
        pages_list = [int(x) for x in args.pages.split(",")]
    except ValueError:
        ap.error("--pages: comma-separated whole numbers")
    if not pages_list or min(pages_list) < 1:
        ap.error("--pages: each at least 1")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    up, _ = ceiling()
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "kvtier": kvtier.__version__, "ceiling_h2d_GBps": round(up, 2),
           "settings": {k: os.environ.get(k) for k in ("KVTIER_KERNEL_BLOCKS", "KVTIER_TRANSFER_LANES")}, "rows": []}
    side = torch.cuda.Stream()
    for name in geoms:
        for backend in backends:
            for pages in pages_list:
                row = cell(GEOMS[name], name, backend, pages, side, up)
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
                with open(args.out, "w") as f:  # what is measured so far
                    json.dump(res, f, indent=1)
    print(table(res["rows"]))


if __name__ == "__main__":
    main()
