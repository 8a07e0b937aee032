"""Where a small per-layer load's time goes: for geometries A, B, C and D (MLA), 16 and 64 pages, both
backends, the caller on a side or the default stream, CPU or CUDA index tensors:

- device time (torch.cuda events around every layer's call, median of ``--reps``) of per-layer calls
  (``load_to_device_per_layer``) and of ``LayerLoader`` (one load of every layer), as µs per layer and as % of
  the pinned-copy ceiling measured in the same run (the higher of the run's start and end, as the transfer
  bench takes it);
- host time of one per-layer call and of one LayerLoader load with the GPU held busy (a ``torch.cuda._sleep``
  kernel ahead on the stream, so no call waits on the device), plain, and split with ``time.perf_counter_ns``
  into: Python before the first native call, the native calls (``kvtier._native``: for the copy engine the
  driver's batch call is inside it), CUDA event work (``torch.cuda.Event`` creation, record, wait), and the
  Python after (the rest); the split's own cost is its total less the plain time;
- per call: native calls, event operations, the route, whether the warm path had plans or launches, the
  kernel launches per layer and the copy engine's copies and batch calls (``engine.last_submit``);
- ``bound``: ``host`` where a warm call's host time is at least 90 % of the device time per layer (the GPU
  waits for the host), else ``device``;
- ``profiles``: per geometry and backend, at the smallest page count (side stream, CPU indices), cProfile's
  top functions by own time over 4 passes of warm per-layer calls.

    PYTHONPATH=python python benches/python/probe_layer_calls.py --out probe-layer-calls.json [--reps 5]
        [--geoms A,B,C,D] [--pages 16,64]

Prints each cell as a JSON line as it is measured, then a table; writes the JSON (rewritten after each
geometry, so a run cut short keeps what it measured) to ``--out``. Needs a CUDA GPU."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import kvtier
from kvtier import LayerLoader, _native
from kvtier_bench.transfer import GEOMS, PS, ceiling, check_exact, event_time, make_device_pool, page_idx, page_layer_bytes

BACKENDS = (("direct", "page_first_direct"), ("kernel", "page_first"))
NATIVE = ("submit_layers", "launch_layers", "plan_sides", "copy_cpu", "submit_layers_background", "validate_transfer")
BUSY_CYCLES = 60_000_000  # ~30 ms of GPU time ahead of each timed batch of calls


class Split:
    """Inside it, every ``kvtier._native`` transfer call and every CUDA event operation is timed: ``segs``
    holds ``(kind, start_ns, end_ns)``, kind ``native`` or ``event``."""

    def __init__(self) -> None:
        self.segs: list[tuple[str, int, int]] = []
        self._undo: list[tuple[object, str, object]] = []

    def _wrap(self, owner: object, name: str, kind: str, static: bool = False) -> None:
        fn = getattr(owner, name, None)
        if fn is None:  # not in this build: nothing to time
            return
        segs, clock = self.segs, time.perf_counter_ns

        def timed(*a, **k):
            t = clock()
            try:
                return fn(*a, **k)
            finally:
                segs.append((kind, t, clock()))

        # a class's own entry (``__new__`` is a staticmethod there), restored as it was
        self._undo.append((owner, name, vars(owner).get(name) if isinstance(owner, type) else fn))
        setattr(owner, name, staticmethod(timed) if static else timed)

    def __enter__(self) -> Split:
        for name in NATIVE:
            self._wrap(_native, name, "native")
        self._wrap(torch.cuda.Event, "__new__", "event", static=True)
        self._wrap(torch.cuda.Event, "record", "event")
        self._wrap(torch.cuda.Event, "wait", "event")
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, fn in reversed(self._undo):
            if fn is None:
                delattr(owner, name)  # it was inherited: the subclass's wrapper goes
            else:
                setattr(owner, name, fn)

    def call(self, fn) -> dict:
        """Runs ``fn`` once; its host time split (ns) and its native calls and event operations."""
        del self.segs[:]
        t0 = time.perf_counter_ns()
        fn()
        t1 = time.perf_counter_ns()
        native = [s for s in self.segs if s[0] == "native"]
        events = [s for s in self.segs if s[0] == "event"]
        first = native[0][1] if native else t1
        ev_before = sum(e - s for _, s, e in events if e <= first)
        ns = {"total": t1 - t0, "native": sum(e - s for _, s, e in native), "events": sum(e - s for _, s, e in events)}
        ns["before"] = first - t0 - ev_before
        ns["after"] = ns["total"] - ns["before"] - ns["native"] - ns["events"]
        return {"ns": ns, "native_calls": len(native), "event_ops": len(events)}


def busy_host_us(stream, fn, calls: int, reps: int) -> tuple[float, bool]:
    """Median host µs of one ``fn()`` over ``reps`` batches of ``calls``, each batch behind a sleep kernel on
    ``stream``; and whether the GPU was still busy when every batch ended (else calls may have waited)."""
    out, busy = [], True
    for _ in range(reps):
        with torch.cuda.stream(stream):
            torch.cuda._sleep(BUSY_CYCLES)
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter_ns() - t0) / calls / 1e3)
        busy = busy and not stream.query()
        torch.cuda.synchronize()
    return statistics.median(out), busy


def split_calls(stream, fn, calls: int, reps: int) -> dict:
    """Median per-call split (µs) of ``fn`` over ``reps`` busy batches of ``calls`` (see :class:`Split`)."""
    parts = []
    with Split() as sp:
        for _ in range(reps):
            with torch.cuda.stream(stream):
                torch.cuda._sleep(BUSY_CYCLES)
            parts += [sp.call(fn) for _ in range(calls)]
            torch.cuda.synchronize()
    out = {f"{k}_us": round(statistics.median([p["ns"][k] for p in parts]) / 1e3, 2)
           for k in ("total", "before", "native", "events", "after")}
    out["native_calls"] = round(statistics.mean([p["native_calls"] for p in parts]), 2)
    out["event_ops"] = round(statistics.mean([p["event_ops"] for p in parts]), 2)
    return out


def cell(hp, dp, backend: str, h, d, caller, side, mode: str, reps: int) -> dict:
    L = hp.layer_num
    state = {"layer": 0}

    def one_layer() -> None:
        hp.load_to_device_per_layer(dp, h, d, state["layer"], backend)
        state["layer"] = (state["layer"] + 1) % L

    with torch.cuda.stream(caller):
        hp.backup_from_device_all_layer(dp, h, d, backend)
        torch.cuda.synchronize()
        t_layer = event_time(lambda: [hp.load_to_device_per_layer(dp, h, d, layer, backend) for layer in range(L)], reps) / L
        exact = check_exact(hp, dp, h, d)
        hp.engine.last_submit = None  # set again only by a copy-engine call of these loads
        hp.load_to_device_per_layer(dp, h, d, 0, backend)
        w = hp._warm
        warm = {"route": str(w.route) if w is not None else None, "warm_plans": w is not None and w.plans is not None,
                "kernel_launches_per_layer": len(getattr(w.plans, "natives", ())) if w is not None else 0,
                "lanes": getattr(w.plans, "lanes", 1) if w is not None else 1,
                "last_submit": list(hp.engine.last_submit) if hp.engine.last_submit else None}
        host_layer, busy = busy_host_us(caller, one_layer, L, reps)
        split_layer = split_calls(caller, one_layer, L, reps)
        loader = LayerLoader(hp, dp, backend, stream=side if mode == "side" else None)
        t_loader = event_time(lambda: loader.load(h, d).synchronize(), reps) / L
        exact = exact and check_exact(hp, dp, h, d)
        loads: list = []
        host_loader, busy_l = busy_host_us(caller, lambda: loads.append(loader.load(h, d)), 1, reps)
        split_loader = split_calls(caller, lambda: loads.append(loader.load(h, d)), 1, reps)
        for ld in loads:
            ld.synchronize()
    return {"us_per_layer": round(t_layer * 1e6, 2), "loader_us_per_layer": round(t_loader * 1e6, 2),
            "host_us_per_call": round(host_layer, 2), "gpu_busy_throughout": busy and busy_l,
            "split_per_call": split_layer, "loader_host_us_per_load": round(host_loader, 2),
            "split_per_loader_load": split_loader, "bit_exact": bool(exact),
            "bound": "host" if host_layer >= 0.9 * t_layer * 1e6 else "device", **warm}


def profile(hp, dp, backend: str, h, d, caller) -> str:
    """cProfile of 4 passes of warm per-layer calls (GPU busy): the top functions by own time."""
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    with torch.cuda.stream(caller):
        for _ in range(4):  # each pass behind its own sleep, drained after (the driver's queue stays short)
            torch.cuda._sleep(BUSY_CYCLES)
            pr.enable()
            for layer in range(hp.layer_num):
                hp.load_to_device_per_layer(dp, h, d, layer, backend)
            pr.disable()
            torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(20)
    return buf.getvalue()


def run_geometry(name: str, pages_list, reps: int, up: float, rows: list, side, profiles: dict) -> None:
    g = GEOMS[name]
    dp = make_device_pool(g, (max(pages_list) + 8) * PS)
    for ts in ((dp.kv_buffer,) if hasattr(dp, "kv_buffer") else (dp.k_buffer, dp.v_buffer)):
        for t in ts:
            t.view(torch.uint8).random_(0, 256)
    for backend, layout in BACKENDS:
        hp = kvtier.host_pool_for(dp, layout=layout, host_to_device_ratio=1.0)
        for pages in pages_list:
            for idev in ("cpu", "cuda"):
                for mode in ("side", "default"):
                    caller = side if mode == "side" else torch.cuda.default_stream()
                    h = page_idx(torch.randperm(hp.page_num)[:pages]).to(idev)
                    d = page_idx(torch.randperm(max(pages_list) + 7)[:pages] + 1).to(idev)
                    r = cell(hp, dp, backend, h, d, caller, side, mode, reps)
                    nbytes = pages * page_layer_bytes(g)
                    row = {"geometry": name, "backend": backend, "layout": layout, "pages": pages, "indices": idev,
                           "stream": mode, "bytes_per_layer": nbytes,
                           "floor_us_per_layer": round(nbytes / up / 1e3, 2), **r}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if pages == min(pages_list) and idev == "cpu" and mode == "side":
                        profiles[f"{name} {backend} {pages} pages, side stream, CPU indices"] = profile(
                            hp, dp, backend, h, d, caller)
        hp.close()
    del dp
    torch.cuda.empty_cache()


def rescale(rows: list, up: float) -> None:
    """The % of the ceiling of every row against ``up`` (GB/s)."""
    for r in rows:
        r["floor_us_per_layer"] = round(r["bytes_per_layer"] / up / 1e3, 2)
        r["layer_pct"] = round(100 * r["bytes_per_layer"] / (r["us_per_layer"] * 1e3) / up, 1)
        r["loader_pct"] = round(100 * r["bytes_per_layer"] / (r["loader_us_per_layer"] * 1e3) / up, 1)


def table(rows: list) -> str:
    head = ("| geom | backend | pages | stream | indices | per-layer % | LayerLoader % | device µs/layer | floor µs | "
            "host µs/call | before / native / events / after µs | native calls, event ops | bound | loader host µs "
            "(native) | route, warm | exact |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        s, sl = r["split_per_call"], r["split_per_loader_load"]
        out.append(f"| {r['geometry']} | {r['backend']} | {r['pages']} | {r['stream']} | {r['indices']} | "
                   f"{r['layer_pct']} | {r['loader_pct']} | {r['us_per_layer']} | {r['floor_us_per_layer']} | "
                   f"{r['host_us_per_call']} | {s['before_us']} / {s['native_us']} / {s['events_us']} / {s['after_us']} | "
                   f"{s['native_calls']}, {s['event_ops']} | {r['bound']} | {r['loader_host_us_per_load']} "
                   f"({sl['native_us']}) | {r['route']}, {r['warm_plans']} | {r['bit_exact']} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--geoms", default="A,B,C,D")
    ap.add_argument("--pages", default="16,64")
    args = ap.parse_args()
    geoms = [x for x in args.geoms.split(",") if x]
    if any(x not in GEOMS for x in geoms):
        ap.error(f"--geoms: choose from {sorted(GEOMS)}")
    pages_list = [int(x) for x in args.pages.split(",")]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    up, down = ceiling()
    print(f"ceiling H2D {up:.1f} GB/s", flush=True)
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "kvtier": kvtier.__version__, "batch_supported": _native.cuda_batch_supported(), "reps": args.reps,
           "busy_cycles": BUSY_CYCLES, "ceiling_runs": {"start": [round(up, 2), round(down, 2)]}, "rows": [],
           "profiles": {}}
    side = torch.cuda.Stream()
    for name in geoms:
        run_geometry(name, pages_list, args.reps, up, res["rows"], side, res["profiles"])
        rescale(res["rows"], up)
        res["ceiling_h2d_GBps"] = up
        with open(args.out, "w") as f:  # what is measured so far
            json.dump(res, f, indent=1)
    up2, down2 = ceiling()
    print(f"ceiling at the end: H2D {up2:.1f} GB/s", flush=True)
    res["ceiling_runs"]["end"] = [round(up2, 2), round(down2, 2)]
    res["ceiling_h2d_GBps"] = max(up, up2)
    rescale(res["rows"], res["ceiling_h2d_GBps"])
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(table(res["rows"]))


if __name__ == "__main__":
    main()
