"""Create + pre-fault + pin a large host buffer: kvtier.HostBuffer against torch's pinned allocator.

    python -m kvtier_bench pin [--gib 16] [--reps 3] [--json out.json]

Each repetition times, in one process and alternating the contenders:
  - torch:  torch.empty(N, dtype=uint8, pin_memory=True)  (cudaHostAlloc through torch's host allocator;
            its cache is emptied between repetitions so every repetition really allocates)
  - kvtier variants: HostBuffer(N) with defaults (huge pages auto, parallel pre-fault, chunked parallel
            registration), and with single-threaded / single-chunk settings to show where the time goes.
It then checks that both buffers are really pinned by timing a 2 GiB host-to-device copy from each (the
pinned-copy ceiling). Prints medians and the ratio torch / kvtier (goal: >= 2x). Needs a CUDA GPU.
"""

from __future__ import annotations

import gc
import json
import platform
import statistics
import time

import torch

import kvtier

from .options import parser
from ._common import bar_plot, check_plot_path, out_dir


def timed(fn):
    t0 = time.perf_counter()
    obj = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, obj


def h2d_gbps(host: torch.Tensor, nbytes: int) -> float:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src = host[:nbytes]
    for _ in range(2):
        dev.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(5):
        s.record()
        dev.copy_(src, non_blocking=True)
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    return nbytes / statistics.median(ts) / 1e9


def main(argv=None) -> None:
    ap = parser("pin")
    args = ap.parse_args(argv)
    if args.gib < 2 or args.reps < 1:  # (its check copies 2 GiB out of each buffer)
        ap.error("--gib must be at least 2 and --reps at least 1")
    check_plot_path(args.plot)
    out_dir(args.out)
    n = args.gib << 30
    torch.cuda.init()
    torch.empty(1, device="cuda")
    variants = {
        "kvtier default": dict(),
        "kvtier 1 GiB chunks, 8 threads": dict(register_chunk_bytes=1 << 30, _threads=8),
        "kvtier base pages": dict(huge_pages="off"),
    }

    def make_kvtier(kw):
        kw = dict(kw)
        threads = kw.pop("_threads", None)
        import os

        if threads:
            os.environ["KVTIER_REGISTER_THREADS"] = str(threads)
        try:
            return kvtier.HostBuffer(n, pin=True, **kw)
        finally:
            os.environ.pop("KVTIER_REGISTER_THREADS", None)

    def make_torch():
        return torch.empty(n, dtype=torch.uint8, pin_memory=True)

    # Warm-up: let the machine back N bytes once (some VMs grow memory on first use).
    make_kvtier({}).close()
    times: dict[str, list[float]] = {"torch pin_memory": [], **{k: [] for k in variants}}
    info: dict[str, object] = {}
    for _ in range(args.reps):
        t, x = timed(make_torch)
        times["torch pin_memory"].append(t)
        del x
        gc.collect()
        torch._C._host_emptyCache()
        for name, kw in variants.items():
            t, b = timed(lambda: make_kvtier(kw))
            times[name].append(t)
            info[name] = {"page_kind": b.page_kind, "chunks": len(b.registered_chunks), "pinned": b.pinned}
            b.close()
            gc.collect()
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"  {k:<36} median {v:.3f} s  {[round(x, 3) for x in times[k]]}", flush=True)
    # Both really pinned? Copy 2 GiB from each at the pinned ceiling.
    with kvtier.HostBuffer(n, pin=True) as b:
        kv_h2d = h2d_gbps(b.as_tensor(), 2 << 30)
        kv_is_pinned = b.as_tensor().is_pinned()
    th = make_torch()
    torch_h2d = h2d_gbps(th, 2 << 30)
    del th
    rows = []
    for k, v in med.items():
        rows.append({"what": k, "median_s": round(v, 3), "all_s": [round(x, 3) for x in times[k]],
                     "GB_per_s": round(n / v / 1e9, 2), "torch_over_this": round(med["torch pin_memory"] / v, 2)})
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{torch.cuda.get_device_name()} / {platform.node()}",
        "torch": torch.__version__,
        "bytes": n,
        "reps": args.reps,
        "rows": rows,
        "variants": info,
        "h2d_2GiB_GBps": {"kvtier": round(kv_h2d, 1), "torch": round(torch_h2d, 1)},
        "kvtier_tensor_is_pinned": kv_is_pinned,
        "ratio_torch_over_kvtier_default": round(med["torch pin_memory"] / med["kvtier default"], 2),
    }
    print(f"create + pre-fault + pin {args.gib} GiB, median of {args.reps} (s):")
    for r in rows:
        print(f"  {r['what']:<36} {r['median_s']:8.3f} s  {r['GB_per_s']:7.2f} GB/s  torch/this = {r['torch_over_this']:.2f}x  {r['all_s']}")
    print(f"pinned H2D 2 GiB: kvtier {kv_h2d:.1f} GB/s, torch {torch_h2d:.1f} GB/s; kvtier tensor is_pinned={kv_is_pinned}")
    print(f"ratio torch / kvtier default: {result['ratio_torch_over_kvtier_default']}x (goal >= 2x)")
    if args.out and not args.json:
        import os

        os.makedirs(args.out, exist_ok=True)
        args.json = os.path.join(args.out, "pin.json")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        bar_plot(args.plot, f"create + pre-fault + pin {args.gib} GiB (median of {args.reps}; higher is faster)",
                 [r["what"] for r in rows], {"GB/s": [r["GB_per_s"] for r in rows]}, "GB/s")


if __name__ == "__main__":
    main()
