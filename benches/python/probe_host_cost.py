"""Host time of one per-layer load call (kvtier's Python path plus the native submission), measured with the
GPU held busy so nothing waits on it: a ``torch.cuda._sleep`` kernel occupies the stream, the calls are timed
on the host, then the stream drains. Also times the native submission alone (cached plans) and the GPU
time of the same loads, so a per-layer call's floor is visible:

    python benches/python/probe_host_cost.py [--out DIR]

Geometry A (MiMo-like: 48 layers, 4 heads, K 192 / V 128, bf16, page 64), B (Llama-3.1-8B-like) and D
(DeepSeek-V3-like MLA, 61 layers of 72 KiB page-layers: the one host-bound at 16 pages), 16 and
64 pages, CPU and CUDA index tensors, side and default stream."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import kvtier
from kvtier import _native
from kvtier_bench._common import write_results
from kvtier_bench.transfer import GEOMS, PS, event_time, make_device_pool, page_idx, page_layer_bytes


def host_us(fn, calls: int, reps: int = 5) -> float:
    out = []
    for _ in range(reps):
        torch.cuda._sleep(200_000_000)  # ~100 ms of GPU time: nothing the calls enqueue can run before it ends
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def measure(hp, dp, h, d, stream, mode: str, layers: int) -> tuple[float, float, float, float]:
    """(warm call, call with every check, native submission alone, end-to-end per layer), µs."""
    state = {"layer": 0}

    def call() -> None:
        hp.load_to_device_per_layer(dp, h, d, state["layer"], "direct")
        state["layer"] = (state["layer"] + 1) % layers

    def cold() -> None:
        hp._warm = None
        call()

    call()
    warm = host_us(call, layers)
    full = host_us(cold, layers)
    w = hp._warm
    plans = hp.engine.dma_plans(w.pairs, w.prepared, False)
    idx = torch.cuda.current_device()
    s = hp.engine.detour_stream(w.pairs[0][1][0].device) if mode == "default" else stream
    native = host_us(lambda: _native.submit_layers(plans, 3, 4, idx, s.cuda_stream, [], True, True, []), layers)

    def all_layers() -> None:
        for layer in range(layers):
            hp.load_to_device_per_layer(dp, h, d, layer, "direct")

    gpu = event_time(all_layers, 5) / layers * 1e6
    return warm, full, native, gpu


def primitives() -> dict:
    """Host µs of the torch and driver calls one per-layer call makes (GPU busy, as above)."""
    s = torch.cuda.Stream()
    dev = torch.device("cuda", torch.cuda.current_device())
    with torch.cuda.stream(s):
        prims = {
            "torch.cuda.current_stream": lambda: torch.cuda.current_stream(dev),
            "torch.cuda.current_device": torch.cuda.current_device,
            "Event()+record": lambda: torch.cuda.Event().record(),
            "stream.wait_stream": lambda: s.wait_stream(torch.cuda.default_stream()),
            "torch.cuda.device(dev) enter/exit": lambda: torch.cuda.device(dev).__enter__(),
        }
        return {k: round(host_us(f, 200), 2) for k, f in prims.items()}


def profile(hp, dp, h, d, layers: int, path: str | None) -> None:
    import cProfile
    import pstats

    pr = cProfile.Profile()
    torch.cuda._sleep(400_000_000)
    pr.enable()
    for _ in range(4):
        for layer in range(layers):
            hp.load_to_device_per_layer(dp, h, d, layer, "direct")
    pr.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(pr).sort_stats("tottime")
    st.print_stats(18)
    if path:
        with open(path, "w") as f:
            pstats.Stats(pr, stream=f).sort_stats("tottime").print_stats(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    prims = primitives()
    print(json.dumps(prims), flush=True)
    rows = []
    side = torch.cuda.Stream()
    for name in ("A", "B", "D"):
        g = GEOMS[name]
        dp = make_device_pool(g, 80 * PS)
        hp = kvtier.host_pool_for(dp, layout="page_first_direct", host_to_device_ratio=1.0)
        L = g["layers"]
        for pages in (16, 64):
            for idev in ("cpu", "cuda"):
                for mode in ("side", "default"):
                    h = page_idx(torch.randperm(hp.page_num)[:pages]).to(idev)
                    d = page_idx(torch.randperm(70)[:pages] + 1).to(idev)
                    stream = side if mode == "side" else torch.cuda.default_stream()
                    with torch.cuda.stream(stream):
                        warm, full, native, gpu = measure(hp, dp, h, d, stream, mode, L)
                        if name in ("A", "D") and pages == 16 and idev == "cpu":
                            profile(hp, dp, h, d, L, f"{args.out}/profile-{name}-{mode}.txt" if args.out else None)
                    nbytes = pages * page_layer_bytes(g)
                    row = {"geometry": name, "pages": pages, "indices": idev, "stream": mode,
                           "host_us_per_call_warm": round(warm, 1), "host_us_per_call_full_checks": round(full, 1),
                           "native_submit_us": round(native, 1), "us_per_layer_end_to_end": round(gpu, 1),
                           "bytes_per_layer": nbytes}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        hp.close()
        del dp
        torch.cuda.empty_cache()
    if args.out:
        write_results(args.out, {"probe-host-cost.json": json.dumps(
            {"gpu": torch.cuda.get_device_name(), "primitives_us": prims, "rows": rows}, indent=1)})


if __name__ == "__main__":
    main()
