"""Counts the kvtier Python functions and the native calls one new page's round trip passes through
(GPU → host → disk → host → GPU: ``backup_from_device_all_layer``, ``PageStore.batch_set_v1`` /
``batch_get_v1``, ``load_to_device_per_layer`` for every layer), with pools and a store already in use
and new index tensors, as an engine makes them for each request (docs/ARCHITECTURE.md).

    python benches/python/count_round_trip.py [cpu|cuda] [--default-stream] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile

import torch

import kvtier
from kvtier import _native


PACKAGE = os.path.dirname(os.path.abspath(kvtier.__file__)) + os.sep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("device", nargs="?", default="cpu")
    ap.add_argument("--default-stream", action="store_true", help="CUDA: issue from the default stream")
    ap.add_argument("--out", help="append the result as one JSON line to this file")
    a = ap.parse_args()
    dev = a.device
    # MiMo-like heads (K 192, V 128), 4 layers, pages of 64 tokens: 96 / 64 KiB chunks, the copy engine's route
    dp = kvtier.DeviceKVPool(16 * 64, 64, 4, 4, 192, 128, torch.bfloat16, dev)
    hp = kvtier.host_pool_for(dp, layout="page_first_direct")
    st = kvtier.PageStore(tempfile.mkdtemp(), capacity_bytes=1 << 28)
    st.register_mem_pool_host(hp)
    step = {"name": None}
    native: dict[str, list[str]] = {"backup": [], "store write": [], "store read": [], "load": []}

    def round_trip(h, d, n):
        step["name"] = "backup"
        hp.backup_from_device_all_layer(dp, h, d, "direct")
        step["name"] = "store write"
        assert st.batch_set_v1([f"page-{n}"], h) == [True]
        step["name"] = "store read"
        assert st.batch_get_v1([f"page-{n}"], h) == [True]
        step["name"] = "load"
        for layer in range(dp.layer_num):
            hp.load_to_device_per_layer(dp, h, d, layer, "direct")
        step["name"] = None

    pages = [(hp.alloc(64), torch.arange(64 * n, 64 * n + 64, device=dev)) for n in (1, 2)]
    side = torch.cuda.Stream() if dev != "cpu" and not a.default_stream else None
    seen: dict = {}
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        round_trip(*pages[0], 1)  # the pools and the store in use
        restore = _count_native(native, step)
        sys.setprofile(lambda f, e, _: e == "call" and f.f_code.co_filename.startswith(PACKAGE) and seen.setdefault(
            f.f_code, f"{f.f_code.co_filename[len(PACKAGE):]}:{f.f_code.co_qualname}"))
        try:
            round_trip(*pages[1], 2)
        finally:
            sys.setprofile(None)
            restore()
    hp.synchronize()
    route = hp.engine.route("direct", hp.sides(), dev if dev == "cpu" else "cuda", tokens=64)
    result = {"route": route, "device": dev, "default_stream": a.default_stream, "python_functions": len(seen),
              "functions": sorted(seen.values()), "native_calls": native, "layers": dp.layer_num}
    print(f"{len(seen)} kvtier Python functions over one new page's round trip ({dev}"
          f"{', default stream' if a.default_stream else ''}):")
    for f in sorted(seen.values()):
        print("  ", f)
    for name, calls in native.items():
        per = f", {len(calls) / dp.layer_num:g} per layer" if name == "load" else ""
        print(f"native calls, {name}: {len(calls)}{per}: {sorted(set(calls))}")
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(result) + "\n")


def _count_native(native: dict, step: dict):
    """Wraps every function of ``kvtier._native`` (the modules call them as ``_native.name``) and the page
    store's native batch calls to record which ran in which step; returns the function that restores them."""
    saved = {}
    for name in dir(_native):
        fn = getattr(_native, name)
        if callable(fn) and not isinstance(fn, type) and not name.startswith("_"):
            saved[name] = fn

            def wrap(*args, _fn=fn, _name=name, **kw):
                if step["name"] is not None:
                    native[step["name"]].append(_name)
                return _fn(*args, **kw)
            setattr(_native, name, wrap)
    batch = kvtier.PageStore._batch

    def counted(self, write, keys, host_indices):  # the native store object's methods cannot be patched
        native[step["name"]].append("PageStore.put_pages" if write else "PageStore.get_pages")
        return batch(self, write, keys, host_indices)
    kvtier.PageStore._batch = counted

    def restore():
        for name, fn in saved.items():
            setattr(_native, name, fn)
        kvtier.PageStore._batch = batch
    return restore


if __name__ == "__main__":
    main()
