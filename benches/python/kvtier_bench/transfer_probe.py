"""Diagnostics behind the transfer bench's misses: where the time goes, measured, not guessed.

    python -m kvtier_bench.transfer_probe [--out DIR] [--reps 5] [--only kernel,launch,direct,overlap]
    python -m kvtier_bench.transfer_probe --ncu      # a few kernel launches to profile under Nsight Compute

Parts (each prints JSON lines, all written to ``probe.json`` in --out):

- ``kernel``: the Triton gather/scatter's tile size, prefetch and warps on geometry A at 256 pages (load
  through LayerLoader and all-layer backup, % of the ceiling), then a block sweep of the best variant.
- ``launch``: host cost per layer at 16 pages: Triton's Python launcher vs kvtier's native launch, and the
  direct path, each through per-layer calls and through LayerLoader.
- ``direct``: copy-engine throughput against chunk size (16–256 KiB per page and layer), for per-layer loads
  and for all-layer backups submitted as one batch per side, one batch per layer, or 1,024-copy batches; with
  the host time spent inside the submitting call.
- ``small``: kernel loads of 16 pages through LayerLoader against tile size, warps and blocks.
- ``staged``: the kernel backend's staged backup against the kernel writing host memory itself.
- ``direct_geoms``: the direct backend on B and C at 256 pages.
- ``overlap_batch`` (not in the default set): the direct backend's overlap against copies per batch call.
- ``backup_host`` (not in the default set): where a 16-page kernel backup's time goes — host time of the
  call, delay until its first kernel starts on the GPU, the kernels' span (CUPTI via torch.profiler), and a
  cProfile of the call's Python side.
(The overlap part, which measured LayerLoader's issue time and kernel configurations beside compute, lives in
the transfer bench's overlap section.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from kvtier import DeviceKVPool, LayerLoader, _native, host_pool_for
from kvtier.transfer import kernels

from .transfer import DT, GEOMS, PS, ceiling, check_exact, event_time, page_idx


def make_pools(g, pages, layout):
    dp = DeviceKVPool((pages + 8) * PS, PS, g["layers"], g["heads"], g["dk"], g["dv"], DT, "cuda")
    for t in dp.k_buffer + dp.v_buffer:
        t.view(torch.uint8).random_(0, 256)
    hp = host_pool_for(dp, layout=layout, host_to_device_ratio=1.0)
    assert hp.k_buffer.is_pinned()
    h = page_idx(torch.randperm(hp.page_num)[:pages])
    d = page_idx(torch.randperm(pages + 7)[:pages] + 1)
    return dp, hp, h, d


def _bytes_per_layer(g, pages):
    return pages * PS * g["heads"] * (g["dk"] + g["dv"]) * 2


def _emit(out, part, row):
    row = {"part": part, **row}
    out.append(row)
    print(json.dumps(row), flush=True)


def part_kernel(out, reps, up, down, stream):
    g = GEOMS["A"]
    dp, hp, h, d = make_pools(g, 256, "page_first")
    nb = _bytes_per_layer(g, 256)
    L = g["layers"]
    loader = LayerLoader(hp, dp, "kernel", stream=stream)
    eng = hp.engine

    def measure():
        with torch.cuda.stream(stream):
            t_load = event_time(lambda: loader.load(h, d).synchronize(), reps) / L
            t_back = event_time(lambda: hp.backup_from_device_all_layer(dp, h, d, "kernel"), reps)
            exact = check_exact(hp, dp, h, d)
        return round(100 * nb / t_load / 1e9 / up, 1), round(100 * nb * L / t_back / 1e9 / down, 1), exact

    best = None
    for tile in (2048, 4096, 8192):
        for prefetch in (False, True):
            for warps in (8, 16):
                eng.tile_words, eng.prefetch, eng.num_warps, eng.blocks = tile, prefetch, warps, 16
                load, back, exact = measure()
                _emit(out, "kernel", {"tile_words": tile, "prefetch": prefetch, "warps": warps, "blocks": 16,
                                      "load_pct": load, "backup_pct": back, "exact": exact})
                if best is None or load + back > best[0]:
                    best = (load + back, tile, prefetch, warps)
    _, tile, prefetch, warps = best
    for blocks in (8, 12, 16, 24, 32, 64):
        eng.tile_words, eng.prefetch, eng.num_warps, eng.blocks = tile, prefetch, warps, blocks
        load, back, exact = measure()
        _emit(out, "kernel_blocks", {"tile_words": tile, "prefetch": prefetch, "warps": warps, "blocks": blocks,
                                     "load_pct": load, "backup_pct": back, "exact": exact})
    _emit(out, "native_status", {"status": kernels.native_status()})
    hp.close()


def part_launch(out, reps, up, stream):
    for geom in ("A", "B"):
        g = GEOMS[geom]
        L = g["layers"]
        for layout, backend in (("page_first", "kernel"), ("page_first_direct", "direct")):
            dp, hp, h, d = make_pools(g, 16, layout)
            nb = _bytes_per_layer(g, 16)
            loader = LayerLoader(hp, dp, backend, stream=stream)
            for native in ((False, True) if backend == "kernel" else (True,)):
                kernels.set_native(native)
                with torch.cuda.stream(stream):
                    t_calls = event_time(lambda: [hp.load_to_device_per_layer(dp, h, d, l, backend) for l in range(L)], reps) / L
                    t_loader = event_time(lambda: loader.load(h, d).synchronize(), reps) / L
                    # host time to issue one LayerLoader load (all layers), GPU idle beforehand
                    hts = []
                    for _ in range(reps):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        ld = loader.load(h, d)
                        hts.append(time.perf_counter() - t0)
                        ld.synchronize()
                    exact = check_exact(hp, dp, h, d)
                _emit(out, "launch", {
                    "geometry": geom, "backend": backend, "native_launch": native, "pages": 16,
                    "calls_us_per_layer": round(t_calls * 1e6, 1), "calls_pct": round(100 * nb / t_calls / 1e9 / up, 1),
                    "loader_us_per_layer": round(t_loader * 1e6, 1), "loader_pct": round(100 * nb / t_loader / 1e9 / up, 1),
                    "loader_issue_host_us": round(statistics.median(hts) * 1e6, 1),
                    "dma_floor_us_per_layer": round(nb / up / 1e3, 1), "exact": exact,
                })
            kernels.set_native(True)
            hp.close()
            del dp
            torch.cuda.empty_cache()


def part_direct(out, reps, up, down, stream):
    L = 32
    for heads in (1, 2, 4, 8, 16):
        g = dict(layers=L, heads=heads, dk=128, dv=128)
        dp, hp, h, d = make_pools(g, 256, "page_first_direct")
        nb = _bytes_per_layer(g, 256)
        chunk = PS * heads * 128 * 2
        loader = LayerLoader(hp, dp, "direct", stream=stream)
        row = {"chunk_KiB": chunk // 1024, "copies_per_layer": 512, "layers": L}
        with torch.cuda.stream(stream):
            t = event_time(lambda: loader.load(h, d).synchronize(), reps) / L
            row["load_pct"] = round(100 * nb / t / 1e9 / up, 1)
            row["load_us_per_copy"] = round(t / 512 * 1e6, 3)
            pairs, p, _ = hp.prepare(dp, h, d, "direct", to_host=True)
            for name, per_layer, limit in (("one_batch_per_side", False, 16384), ("batch_per_layer", True, 16384),
                                           ("batches_of_1024", False, 1024), ("batches_of_256", False, 256)):
                old = _native.cuda_set_batch_limit(limit)
                t = event_time(lambda: hp.engine.copy(pairs, p, 0, L, to_host=True, backend="direct", per_layer=per_layer), reps)
                hts = []
                for _ in range(reps):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    hp.engine.copy(pairs, p, 0, L, to_host=True, backend="direct", per_layer=per_layer)
                    hts.append(time.perf_counter() - t0)
                    torch.cuda.synchronize()
                _native.cuda_set_batch_limit(old)
                row[f"backup_{name}_pct"] = round(100 * nb * L / t / 1e9 / down, 1)
                row[f"backup_{name}_host_ms"] = round(statistics.median(hts) * 1e3, 2)
                row[f"backup_{name}_gpu_ms"] = round(t * 1e3, 2)
            row["exact"] = check_exact(hp, dp, h, d)
        _emit(out, "direct", row)
        hp.close()
        del dp
        torch.cuda.empty_cache()


KERNEL_CONFIGS = ((4096, 16), (2048, 8), (1024, 4), (2048, 16), (1024, 8))  # (tile words, warps)


def _set_kernel(hp, tile, warps, blocks, prefetch=True):
    eng = hp.engine
    eng.tile_words, eng.num_warps, eng.blocks, eng.prefetch = tile, warps, blocks, prefetch


def part_small(out, reps, up, stream):
    """Kernel loads of 16 pages through LayerLoader: tile, warps and blocks."""
    for geom in ("A", "B"):
        g = GEOMS[geom]
        L = g["layers"]
        dp, hp, h, d = make_pools(g, 16, "page_first")
        nb = _bytes_per_layer(g, 16)
        loader = LayerLoader(hp, dp, "kernel", stream=stream)
        for blocks in (16, 32):
            for tile, warps in KERNEL_CONFIGS:
                _set_kernel(hp, tile, warps, blocks)
                with torch.cuda.stream(stream):
                    t = event_time(lambda: loader.load(h, d).synchronize(), reps) / L
                    exact = check_exact(hp, dp, h, d)
                _emit(out, "small", {"geometry": geom, "blocks": blocks, "tile_words": tile, "warps": warps,
                                     "loader_us_per_layer": round(t * 1e6, 1),
                                     "loader_pct": round(100 * nb / t / 1e9 / up, 1), "exact": exact})
        hp.close()
        del dp
        torch.cuda.empty_cache()


def part_staged(out, reps, down, stream):
    """Kernel-backend backups: staged (gather + copy engine) against the kernel writing host memory."""
    for geom in ("A", "B", "C"):
        g = GEOMS[geom]
        for pages in (16, 256):
            dp, hp, h, d = make_pools(g, pages, "page_first")
            nb = _bytes_per_layer(g, pages) * g["layers"]
            row = {"geometry": geom, "pages": pages}
            hp.engine.staged_min_bytes = 0  # compare both paths at every size
            for staged in (True, False):
                hp.engine.staged_backup = staged
                with torch.cuda.stream(stream):
                    t = event_time(lambda: hp.backup_from_device_all_layer(dp, h, d, "kernel"), reps)
                    exact = check_exact(hp, dp, h, d)
                name = "staged" if staged else "sm_writes"
                row[f"{name}_pct"] = round(100 * nb / t / 1e9 / down, 1)
                row[f"{name}_exact"] = exact
            _emit(out, "staged", row)
            hp.close()
            del dp
            torch.cuda.empty_cache()


def part_direct_geoms(out, reps, up, down, stream):
    """Direct backend at 256 pages for B and C with the default batch limit."""
    for geom in ("B", "C"):
        g = GEOMS[geom]
        L = g["layers"]
        dp, hp, h, d = make_pools(g, 256, "page_first_direct")
        nb = _bytes_per_layer(g, 256)
        loader = LayerLoader(hp, dp, "direct", stream=stream)
        with torch.cuda.stream(stream):
            t_load = event_time(lambda: loader.load(h, d).synchronize(), reps) / L
            t_back = event_time(lambda: hp.backup_from_device_all_layer(dp, h, d, "direct"), reps)
            exact = check_exact(hp, dp, h, d)
        _emit(out, "direct_geoms", {"geometry": geom, "pages": 256, "load_pct": round(100 * nb / t_load / 1e9 / up, 1),
                                    "backup_pct": round(100 * nb * L / t_back / 1e9 / down, 1), "exact": exact,
                                    "batch_limit": _native.cuda_set_batch_limit(_native.cuda_set_batch_limit(1))})
        hp.close()
        del dp
        torch.cuda.empty_cache()


def part_overlap_batch(out, reps):
    """Direct-backend overlap (A, 256 pages, compute as long as the transfer) against the copies per
    ``cuMemcpyBatchAsync`` call: a hypothesis for the direct path's overlap above 1.15x is that the submission
    thread holds the driver for the length of a large batch call while the compute thread waits to launch;
    smaller calls would interleave better (the per-copy path, one call per copy, overlapped at 1.035x)."""
    from .transfer import overlap

    g = GEOMS["A"]
    dp = DeviceKVPool(264 * PS, PS, g["layers"], g["heads"], g["dk"], g["dv"], DT, "cuda")
    for t in dp.k_buffer + dp.v_buffer:
        t.view(torch.uint8).random_(0, 256)
    for limit in (1024, 256, 64, 16):
        old = _native.cuda_set_batch_limit(limit)
        try:
            res = overlap(dp, reps, trials=3, cases=(("page_first_direct", "direct", True),))["direct"]
        finally:
            _native.cuda_set_batch_limit(old)
        _emit(out, "overlap_batch", {"batch_limit": limit, **res})
    del dp
    torch.cuda.empty_cache()


def _gpu_timeline(fn, calls: int) -> list[dict]:
    """CUPTI timeline of ``calls`` synchronized calls of ``fn``: per call, the host time inside ``fn``, the
    delay from entering ``fn`` to the first GPU activity it caused, the span of that activity and the whole
    call (entry to last GPU activity's end), in microseconds. Host and GPU timestamps share Kineto's clock."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            torch.cuda.synchronize()
            with record_function(f"kvtier_call_{i}"):
                fn()
            torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    calls_ev = sorted((e for e in evs if str(e.get("name", "")).startswith("kvtier_call_")
                       and e.get("cat") in ("user_annotation", "cpu_op")), key=lambda e: e["ts"])
    gpu = sorted((e for e in evs if e.get("cat") in ("kernel", "gpu_memcpy")), key=lambda e: e["ts"])
    rows = []
    for i, c in enumerate(calls_ev):
        nxt = calls_ev[i + 1]["ts"] if i + 1 < len(calls_ev) else float("inf")
        mine = [e for e in gpu if c["ts"] <= e["ts"] < nxt]
        if not mine:
            continue
        first, last = mine[0]["ts"], max(e["ts"] + e["dur"] for e in mine)
        rows.append({"host_us": c["dur"], "first_gpu_after_us": first - c["ts"], "gpu_span_us": last - first,
                     "call_to_last_gpu_us": last - c["ts"], "gpu_ops": len(mine),
                     "gpu_busy_us": sum(e["dur"] for e in mine)})
    return rows


def part_backup_host(out, reps, down, stream):
    """Kernel-backend all-layer backups of 16 pages (A, B): the event-timed figure the bench reports, then a
    CUPTI timeline of the same calls (host time, delay until the first kernel, kernel span) and the top
    functions of a cProfile of the call's Python side."""
    import cProfile
    import io
    import pstats

    for geom in ("A", "B"):
        g = GEOMS[geom]
        dp, hp, h, d = make_pools(g, 16, "page_first")
        nb = _bytes_per_layer(g, 16) * g["layers"]
        with torch.cuda.stream(stream):
            t = event_time(lambda: hp.backup_from_device_all_layer(dp, h, d, "kernel"), reps)
            tl = _gpu_timeline(lambda: hp.backup_from_device_all_layer(dp, h, d, "kernel"), 5)
            host = []
            for _ in range(reps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                hp.backup_from_device_all_layer(dp, h, d, "kernel")
                host.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(20):
                hp.backup_from_device_all_layer(dp, h, d, "kernel")
                torch.cuda.synchronize()
            prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
        med = {k: statistics.median(r[k] for r in tl) for k in tl[0]} if tl else {}
        _emit(out, "backup_host", {"geometry": geom, "pages": 16, "event_ms": round(t * 1e3, 3),
                                   "pct": round(100 * nb / t / 1e9 / down, 1),
                                   "host_call_ms": round(statistics.median(host) * 1e3, 3),
                                   "timeline_median_us": {k: round(v, 1) for k, v in med.items()},
                                   "timeline": tl})
        print(buf.getvalue(), flush=True)
        out[-1]["cprofile_top"] = buf.getvalue().splitlines()[:40]
        hp.close()
        del dp
        torch.cuda.empty_cache()


def ncu_target(pages: int = 256):
    """A short run for Nsight Compute: geometry A, ``pages`` pages, kernel backend; 3 warm-up loads and
    backups, then one LayerLoader load (96 launches) and one backup (2 launches when it is not staged)."""
    g = GEOMS["A"]
    dp, hp, h, d = make_pools(g, pages, "page_first")
    loader = LayerLoader(hp, dp, "kernel")
    for _ in range(3):
        loader.load(h, d).synchronize()
        hp.backup_from_device_all_layer(dp, h, d, "kernel")
    torch.cuda.synchronize()
    loader.load(h, d).synchronize()
    hp.backup_from_device_all_layer(dp, h, d, "kernel")
    torch.cuda.synchronize()
    print("ncu target done", kernels.native_status(), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m kvtier_bench.transfer_probe")
    ap.add_argument("--out", default="benches/results")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", default="kernel,launch,direct,small,staged,direct_geoms")
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--pages", type=int, default=256, help="pages for --ncu")
    args = ap.parse_args(argv)
    if args.ncu:
        ncu_target(args.pages)
        return
    os.makedirs(args.out, exist_ok=True)
    up, down = ceiling()
    out = [{"part": "ceiling", "h2d_GBps": round(up, 2), "d2h_GBps": round(down, 2), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S")}]
    print(json.dumps(out[0]), flush=True)
    stream = torch.cuda.Stream()
    parts = args.only.split(",")
    if "kernel" in parts:
        part_kernel(out, args.reps, up, down, stream)
    if "launch" in parts:
        part_launch(out, args.reps, up, stream)
    if "direct" in parts:
        part_direct(out, args.reps, up, down, stream)
    if "small" in parts:
        part_small(out, args.reps, up, stream)
    if "staged" in parts:
        part_staged(out, args.reps, down, stream)
    if "overlap_batch" in parts:
        part_overlap_batch(out, args.reps)
    if "backup_host" in parts:
        part_backup_host(out, args.reps, down, stream)
    if "direct_geoms" in parts:
        part_direct_geoms(out, args.reps, up, down, stream)
    with open(os.path.join(args.out, "probe.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
