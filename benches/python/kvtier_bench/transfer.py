"""Host<->device KV transfer throughput against the PCIe ceiling measured in the same run.

    python -m kvtier_bench transfer [--out DIR] [--geoms A,B,C,D] [--pages 16,64,256,1024] [--reps 7]

1. Ceiling: pinned contiguous H2D and D2H copies of 2 GiB (torch, median of 5).
2. For each geometry, backend and page count:
   - load: ``load_to_device_per_layer`` for every layer back to back on a side stream; reported as µs per
     layer and GB/s, median over repetitions; and the same through ``LayerLoader`` (validation and planning
     once per load, one native call for all layers);
   - backup: ``backup_from_device_all_layer`` (ms and GB/s);
   each as a percentage of the ceiling, and checked bit-exact.
   Baseline row: a naive loop of one torch ``copy_(non_blocking=True)`` per (page, layer, K/V).
3. Kernel-backend block sweep (geometry A, 256 pages).
4. Overlap (geometry A, 256 pages, 3 trials): a per-layer matmul loop sized like one layer's load, run with
   LayerLoader (``ratio_to_max``: overlapped time / max(compute, transfer)); the same with each layer's
   compute as one CUDA graph (``ratio_to_max_layer_graphs``); and ``compute_slowdown``: the whole compute
   loop replayed as one graph beside a load that is never waited on, against alone (device contention).

Geometries (bf16, page 64): A = MiMo-V2-like 48 layers, 4 KV heads, K 192 / V 128; B = Llama-3.1-8B-like
32 layers, 8 heads, 128 / 128; C = MiMo at TP 8: 48 layers, 1 head, 192 / 128; D = DeepSeek-V3-like MLA:
61 layers, kv_lora_rank 512 + qk_rope_head_dim 64 (one 1,152-byte row per token and layer).
Prints the results; writes ``transfer.json`` and ``transfer.md`` only into --out. Needs a CUDA GPU.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

import kvtier
from kvtier import DeviceKVPool, LayerLoader, MLADeviceKVPool, device_layers, host_pool_for
from kvtier import _native, config

from .options import parser
from ._common import check_plot_path, out_dir, write_results

GEOMS = {
    "A": dict(layers=48, heads=4, dk=192, dv=128),
    "B": dict(layers=32, heads=8, dk=128, dv=128),
    "C": dict(layers=48, heads=1, dk=192, dv=128),
    "D": dict(layers=61, mla=(512, 64)),  # DeepSeek-V3-like MLA: one latent + rope row per token and layer
    "E": dict(layers=48, heads=2, dk=192, dv=128),  # MiMo at TP 4: 48 / 32 KiB per page-layer (the route's edge)
}
PS = 64
DT = torch.bfloat16


def event_time(fn, reps: int, warm: int = 2) -> float:
    """Median seconds of ``fn`` between two events on the current stream."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    return statistics.median(ts)


def ceiling() -> tuple[float, float]:
    n = 2 << 30
    g = torch.empty(n, dtype=torch.uint8, device="cuda")
    h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    up = n / event_time(lambda: g.copy_(h, non_blocking=True), 5) / 1e9
    down = n / event_time(lambda: h.copy_(g, non_blocking=True), 5) / 1e9
    del g, h
    return up, down


def page_idx(pages: torch.Tensor) -> torch.Tensor:
    return (pages[:, None] * PS + torch.arange(PS)[None]).reshape(-1)


def host_sides(hp) -> tuple:
    """The host pool's tensors, one per side (K and V, or an MLA pool's latent KV)."""
    return (hp.kv_buffer,) if hasattr(hp, "kv_lora_rank") else (hp.k_buffer, hp.v_buffer)


def make_device_pool(g, size):
    if "mla" in g:
        return MLADeviceKVPool(size, PS, g["layers"], *g["mla"], DT, "cuda")
    return DeviceKVPool(size, PS, g["layers"], g["heads"], g["dk"], g["dv"], DT, "cuda")


def page_layer_bytes(g) -> int:
    """Bytes of one page of one layer, every side."""
    return PS * (sum(g["mla"]) if "mla" in g else g["heads"] * (g["dk"] + g["dv"])) * 2


def naive_load(hp, dp, hpages, dpages, layer):
    for p, q in zip(hpages.tolist(), dpages.tolist()):
        for host, dev in zip(host_sides(hp), device_layers(dp)):
            dev[layer][q * PS : (q + 1) * PS].copy_(host[p, layer], non_blocking=True)


def naive_backup(hp, dp, hpages, dpages):
    for layer in range(hp.layer_num):
        for p, q in zip(hpages.tolist(), dpages.tolist()):
            for host, dev in zip(host_sides(hp), device_layers(dp)):
                host[p, layer].copy_(dev[layer][q * PS : (q + 1) * PS], non_blocking=True)


def check_exact(hp, dp, h, d) -> bool:
    hc = h.cpu()
    ok = True
    for layer in (0, hp.layer_num - 1):
        for host, dev in zip(host_sides(hp), device_layers(dp)):
            rows = host[hc // PS, layer, hc % PS] if hp.layout == "page_first_direct" else host[hc, layer]
            ok &= torch.equal(rows.view(torch.uint8), dev[layer][d].view(torch.uint8).cpu())
    return bool(ok)


def run_geometry(name, g, pages_list, reps, ceil_up, ceil_down, rows_out, stream, modes=("side",), index_devs=("cpu",)):
    """Every backend and page count of geometry ``g``, with the caller on ``stream`` ("side") and/or on the
    default stream ("default": a plain script; its LayerLoader gets its own stream, as by default), with
    index tensors on the CPU and/or on the GPU."""
    max_pages = max(pages_list)
    dp = make_device_pool(g, (max_pages + 8) * PS)
    for side in device_layers(dp):
        for t in side:
            t.view(torch.uint8).random_(0, 256)
    per_layer = page_layer_bytes(g)  # bytes per page per layer, K+V
    for layout, backend in (("page_first_direct", "direct"), ("page_first", "kernel"), ("page_first_direct", "naive")):
        hp = host_pool_for(dp, layout=layout, host_to_device_ratio=1.0)
        assert all(t.is_pinned() for t in host_sides(hp))
        for mode, idev, npages in [(m, i, n) for m in modes for i in index_devs for n in pages_list]:
            if backend == "naive" and (npages > 256 or mode != "side" or idev != "cpu"):
                continue
            caller = stream if mode == "side" else torch.cuda.default_stream()
            hpages = torch.randperm(hp.page_num)[:npages]
            dpages = torch.randperm(max_pages + 7)[:npages] + 1
            h, d = page_idx(hpages).to(idev), page_idx(dpages).to(idev)
            nb_layer = npages * per_layer
            with torch.cuda.stream(caller):
                if backend == "naive":
                    t_load = event_time(lambda: [naive_load(hp, dp, hpages, dpages, l) for l in range(g["layers"])], max(3, reps // 2)) / g["layers"]
                    t_back = event_time(lambda: naive_backup(hp, dp, hpages, dpages), max(3, reps // 2))
                    exact = None
                else:
                    t_back = event_time(lambda: hp.backup_from_device_all_layer(dp, h, d, backend), reps)
                    exact = check_exact(hp, dp, h, d)
                    t_load = event_time(lambda: [hp.load_to_device_per_layer(dp, h, d, l, backend) for l in range(g["layers"])], reps) / g["layers"]
                    exact = exact and check_exact(hp, dp, h, d)
                    loader = LayerLoader(hp, dp, backend, stream=stream if mode == "side" else None)
                    t_loader = event_time(lambda: loader.load(h, d).synchronize(), reps) / g["layers"]
                    exact = exact and check_exact(hp, dp, h, d)
            up = nb_layer / t_load / 1e9
            down = nb_layer * g["layers"] / t_back / 1e9
            row = {
                "geometry": name, "backend": backend, "layout": layout, "stream": mode, "indices": idev,
                "pages": npages,
                "load_us_per_layer": round(t_load * 1e6, 1), "load_GBps": round(up, 2),
                "load_pct": round(100 * up / ceil_up, 1), "backup_ms": round(t_back * 1e3, 3),
                "backup_GBps": round(down, 2), "backup_pct": round(100 * down / ceil_down, 1), "bit_exact": exact,
            }
            if backend != "naive":
                row["loader_us_per_layer"] = round(t_loader * 1e6, 1)
                row["loader_pct"] = round(100 * nb_layer / t_loader / 1e9 / ceil_up, 1)
            if backend != "naive":  # what moved the bytes (kvtier.transfer.TransferEngine.route)
                row["load_route"] = hp.engine.route(backend, hp.sides(), "cuda", tokens=len(h))
                row["backup_route"] = hp.engine.route(backend, hp.sides(), "cuda", to_host=True, tokens=len(h))
            if backend == "kernel":
                row["kernel_blocks"] = config.kernel_blocks()
            rows_out.append(row)
            print(json.dumps(row), flush=True)
        hp.close()
    return dp


def block_sweep(dp, stream, reps, ceil_up, ceil_down):
    out = []
    hp = host_pool_for(dp, layout="page_first", host_to_device_ratio=1.0)
    hpages = torch.randperm(hp.page_num)[:256]
    dpages = torch.randperm(256)[:256] + 1
    h, d = page_idx(hpages), page_idx(dpages)
    L = hp.layer_num
    nb_layer = 256 * PS * hp.head_num * (hp.head_dim + hp.v_head_dim) * 2
    for blocks in (4, 8, 16, 24, 32):
        for warps in (16,):
            hp.engine.blocks, hp.engine.num_warps = blocks, warps
            with torch.cuda.stream(stream):
                t_load = event_time(lambda: [hp.load_to_device_per_layer(dp, h, d, l, "kernel") for l in range(L)], reps) / L
                t_back = event_time(lambda: hp.backup_from_device_all_layer(dp, h, d, "kernel"), reps)
            r = {"blocks": blocks, "warps": warps, "load_pct": round(100 * nb_layer / t_load / 1e9 / ceil_up, 1),
                 "backup_pct": round(100 * nb_layer * L / t_back / 1e9 / ceil_down, 1)}
            out.append(r)
            print("sweep", json.dumps(r), flush=True)
    hp.close()
    return out


OVERLAP_CASES = (("page_first_direct", "direct", True), ("page_first_direct", "direct", False), ("page_first", "kernel", True))


def overlap(dp, reps, trials: int = 3, cases=OVERLAP_CASES):
    """Per-layer compute sized like one layer's load, with and without LayerLoader overlap (``trials`` runs,
    median): as one matmul kernel per layer (the transfer issue's definition: ``ratio_to_max_one_kernel``),
    as ``k`` small matmuls per layer launched eagerly from Python (``ratio_to_max``: 48·k host launches
    compete with the load's submission for the driver), and as one CUDA graph per layer; and how much a
    concurrent load slows the compute itself (compute alone against compute issued
    right after a load, with no waits, the compute replayed as one CUDA graph so host launch delays do not
    count: the kernel backend takes SMs, the direct one should not)."""
    out = {}
    L = dp.layer_num
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    # one matmul's device time, from 64 back to back (a single timed launch also counts launch latency,
    # which made the compute loop ~40 % shorter than the transfer it was meant to match)
    one = event_time(lambda: [a @ a for _ in range(64)], reps) / 64
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    cal_rows = 8192
    xc = torch.randn(cal_rows, 4096, device="cuda", dtype=torch.bfloat16)
    t_cal = event_time(lambda: [xc @ w for _ in range(8)], reps) / 8
    del xc
    for layout, backend, batch in cases:
        hp = host_pool_for(dp, layout=layout, host_to_device_ratio=1.0)
        hp.engine.batch = batch
        h, d = page_idx(torch.arange(256)), page_idx(torch.arange(256) + 1)
        loader = LayerLoader(hp, dp, backend)
        runs = []
        for _ in range(trials if batch else 1):
            t_xfer = event_time(lambda: loader.load(h, d).synchronize(), reps)
            # calibrate: matmuls per layer so that one layer of compute ~ one layer of transfer
            k = max(1, round(t_xfer / L / one))

            def compute_only():
                for _ in range(L):
                    for _ in range(k):
                        a @ a

            t_comp = event_time(compute_only, reps)

            def both():
                load = loader.load(h, d)
                for layer in range(L):
                    load.wait(layer)
                    for _ in range(k):
                        a @ a

            t_both = event_time(both, reps)
            # the compute loop as one CUDA graph, so that launching it cannot be delayed by the host
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                compute_only()  # warm-up on the capture stream
                with torch.cuda.graph(graph, stream=side):
                    compute_only()
            torch.cuda.current_stream().wait_stream(side)
            t_comp_graph = event_time(graph.replay, reps)
            # the same overlap with each layer's compute as one CUDA graph (as engines that capture their
            # forward pass run it): host launch costs and contention for the driver mostly leave the picture
            layer_graph = torch.cuda.CUDAGraph()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                with torch.cuda.graph(layer_graph, stream=side):
                    for _ in range(k):
                        a @ a
            torch.cuda.current_stream().wait_stream(side)

            def both_graphed():
                load = loader.load(h, d)
                for layer in range(L):
                    load.wait(layer)
                    layer_graph.replay()

            t_both_graphed = event_time(both_graphed, reps)
            # the definition: one compute kernel per layer, sized to take about as long as one layer's
            # load (a single matmul whose row count is calibrated), so the host launches 48 kernels, not 48·k
            # (a second step corrects the first guess: a matmul's time is not quite linear in its rows)
            rows = max(128, round(cal_rows * (t_xfer / L) / t_cal / 128) * 128)
            for _ in range(2):
                x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
                t_one = event_time(lambda: [x @ w for _ in range(L)], reps)
                rows, guess = max(128, round(rows * t_xfer / t_one / 128) * 128), rows
                if rows == guess:
                    break
            rows = guess

            def both_one():
                load = loader.load(h, d)
                for layer in range(L):
                    load.wait(layer)
                    x @ w

            t_both_one = event_time(both_one, reps)
            del x
            loads = []

            def compute_beside_load():
                loads.append(loader.load(h, d))  # issued first, never waited on: only device contention remains
                graph.replay()

            t_beside = event_time(compute_beside_load, reps)
            for ld in loads:
                ld.synchronize()
            runs.append({"transfer_ms": round(t_xfer * 1e3, 3), "compute_ms": round(t_comp * 1e3, 3),
                         "overlapped_ms": round(t_both * 1e3, 3), "ratio_to_max": round(t_both / max(t_comp, t_xfer), 3),
                         "overlapped_layer_graphs_ms": round(t_both_graphed * 1e3, 3),
                         "ratio_to_max_layer_graphs": round(t_both_graphed / max(t_comp_graph, t_xfer), 3),
                         "compute_graph_ms": round(t_comp_graph * 1e3, 3), "compute_beside_load_ms": round(t_beside * 1e3, 3),
                         "compute_slowdown": round(t_beside / t_comp_graph, 3), "matmuls_per_layer": k,
                         "one_kernel_compute_ms": round(t_one * 1e3, 3), "one_kernel_overlapped_ms": round(t_both_one * 1e3, 3),
                         "ratio_to_max_one_kernel": round(t_both_one / max(t_one, t_xfer), 3), "one_kernel_rows": rows})
        torch.cuda.synchronize()
        med = sorted(runs, key=lambda r: r["ratio_to_max"])[len(runs) // 2]
        out[backend if batch else backend + " (one cuMemcpyAsync per chunk)"] = {
            **med, "ratios_all_runs": [r["ratio_to_max"] for r in runs],
            "one_kernel_ratios_all_runs": [r["ratio_to_max_one_kernel"] for r in runs]}
        print("overlap", backend, batch, json.dumps(med), flush=True)
        hp.close()
    if "kernel" in out and "direct" in out:
        out["kernel_vs_direct_overlapped_time"] = round(out["kernel"]["overlapped_ms"] / out["direct"]["overlapped_ms"], 3)
        out["kernel_vs_direct_compute_slowdown"] = round(out["kernel"]["compute_slowdown"] / out["direct"]["compute_slowdown"], 3)
    return out


def rescale(res, up: float, down: float) -> None:
    """Restate every percentage of ``res`` against the ceilings ``up``/``down`` (GB/s)."""
    fu, fd = res["ceiling_h2d_GBps"] / up, res["ceiling_d2h_GBps"] / down
    for r in res["rows"] + res.get("sweep", []):
        for key, f in (("load_pct", fu), ("loader_pct", fu), ("backup_pct", fd)):
            if key in r:
                r[key] = round(r[key] * f, 1)
    res["ceiling_h2d_GBps"], res["ceiling_d2h_GBps"] = up, down


def markdown(res) -> str:
    lines = [
        f"# kvtier transfer bench — {res['date']} — {res['gpu']}",
        "",
        f"Ceiling (pinned contiguous 2 GiB, the higher of the run's start and end {res.get('ceiling_runs')}): "
        f"H2D {res['ceiling_h2d_GBps']:.1f} GB/s, D2H {res['ceiling_d2h_GBps']:.1f} GB/s. "
        f"Batched DMA available: {res['batch_supported']} (flags {res.get('batch_flags')}). Kernel blocks: {res['kernel_blocks']}, warps {res['kernel_warps']}, "
        f"lanes {res.get('transfer_lanes')}, backup {res.get('kernel_backup')}. Direct: kernel below "
        f"{res.get('direct_kernel_below_kb')} KiB chunks, backup {res.get('direct_backup')}.",
        "",
        "| geom | backend | layout | caller stream | indices | pages | load µs/layer | load GB/s | load % | LayerLoader µs/layer | LayerLoader % | backup ms | backup GB/s | backup % | exact | route (load / backup) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['geometry']} | {r['backend']} | {r['layout']} | {r.get('stream', 'side')} | {r.get('indices', 'cpu')} | {r['pages']} | {r['load_us_per_layer']} | {r['load_GBps']} | "
            f"{r['load_pct']} | {r.get('loader_us_per_layer', '-')} | {r.get('loader_pct', '-')} | {r['backup_ms']} | "
            f"{r['backup_GBps']} | {r['backup_pct']} | {r['bit_exact']} | {r.get('load_route', '-')} / {r.get('backup_route', '-')} |"
        )
    if res.get("overlap"):
        lines += ["", "Overlap (geometry A, 256 pages): " + json.dumps(res["overlap"])]
    if res.get("sweep"):
        lines += ["", "Kernel block sweep (A, 256 pages): " + json.dumps(res["sweep"])]
    return "\n".join(lines) + "\n"


def plot(res, path: str) -> None:
    """Load and backup GB/s against pages, one line per (geometry, backend), the ceilings as dashed lines."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("python -m kvtier_bench transfer --plot needs matplotlib (pip install matplotlib)") from None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, what, ceil in ((axes[0], "load", res["ceiling_h2d_GBps"]), (axes[1], "backup", res["ceiling_d2h_GBps"])):
        series: dict = {}
        for r in res["rows"]:
            series.setdefault((r["geometry"], r["backend"]), []).append((r["pages"], r[f"{what}_GBps"]))
        for (geom, backend), pts in sorted(series.items()):
            xs, ys = zip(*sorted(pts))
            ax.plot(xs, ys, marker="o", label=f"{geom} {backend}")
        ax.axhline(ceil, linestyle="--", color="k", label="pinned copy ceiling")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("pages")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{what} ({res['gpu']})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = parser("transfer")
    args = ap.parse_args(argv)
    if any(g not in GEOMS for g in args.geoms.split(",")):
        ap.error(f"--geoms: choose from {sorted(GEOMS)}, got {args.geoms!r}")
    check_plot_path(args.plot)
    out = out_dir(args.out)
    pages_list = [int(x) for x in args.pages.split(",")]
    up, down = ceiling()
    print(f"ceiling H2D {up:.1f} GB/s, D2H {down:.1f} GB/s", flush=True)
    res = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "kvtier": kvtier.__version__, "ceiling_h2d_GBps": up, "ceiling_d2h_GBps": down,
        "batch_supported": _native.cuda_batch_supported(), "kernel_blocks": config.kernel_blocks(),
        "kernel_warps": config.kernel_warps(), "kernel_tile_words": kvtier.transfer.KERNEL_TILE_WORDS, "transfer_lanes": config.transfer_lanes(),
        "kernel_backup": config.kernel_backup(), "direct_kernel_below_kb": config.direct_kernel_below() >> 10,
        "direct_backup": config.direct_backup(), "rows": [],
    }
    stream = torch.cuda.Stream()
    for name in args.geoms.split(","):
        modes = tuple(m for m in args.streams.split(",") if m)
        if not modes or any(m not in ("side", "default") for m in modes):
            ap.error(f"--streams: expected side and/or default, got {args.streams!r}")
        idevs = tuple(x for x in args.indices.split(",") if x)
        if not idevs or any(x not in ("cpu", "cuda") for x in idevs):
            ap.error(f"--indices: expected cpu and/or cuda, got {args.indices!r}")
        dp = run_geometry(name, GEOMS[name], pages_list, args.reps, up, down, res["rows"], stream, modes, idevs)
        if name == "A":
            if not args.no_sweep:
                res["sweep"] = block_sweep(dp, stream, 5, up, down)
            if not args.no_overlap:
                res["overlap"] = overlap(dp, 5)
        del dp
        torch.cuda.empty_cache()
    res["batch_flags"] = _native.cuda_batch_flags()
    # The ceiling again at the end: this machine is shared and one 2 GiB copy series can land in a slow
    # moment (H2D measured 50.3 GB/s once, against 55.4 minutes later). The higher of the two is the
    # ceiling every ratio is taken against (conservative for kvtier); both are recorded.
    up2, down2 = ceiling()
    print(f"ceiling at the end: H2D {up2:.1f} GB/s, D2H {down2:.1f} GB/s", flush=True)
    res["ceiling_runs"] = {"start": [round(up, 2), round(down, 2)], "end": [round(up2, 2), round(down2, 2)]}
    rescale(res, max(up, up2), max(down, down2))
    md = markdown(res)
    print(md)
    if out is not None:
        write_results(out, {"transfer.json": json.dumps(res, indent=1), "transfer.md": md})
    if args.plot:
        plot(res, args.plot)


if __name__ == "__main__":
    main()
