"""Where each request of the demo's transformers workload spends its time with kvtier: ``KVTier.cache`` (the
restore: planning, taking host pages, a split's head forward and tail read), the host time inside the cache's
``update`` calls during the rest of the prompt, and the rest, per request, beside its plan and no tier's
time. The workload is the demo's (``kvtier_demo.workload_transformers``, examples/), run as the demo runs it (on CUDA
without cuDNN's attention: the workload turns it off, see ``CUDNN_NOTE``).

    PYTHONPATH=python python benches/python/probe_demo_requests.py [--window N|all] [--out probe.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvtier_demo import workload_transformers as wt
from kvtier.integrations.transformers import cache as tc
from kvtier.integrations import transformers as kt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="demo-requests.json")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--window", default=None, help="the KVTier's window: layers, or 'all' (default: the demo's)")
    a = ap.parse_args()
    window = None if a.window is None else 0 if a.window == "all" else int(a.window)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    calls: list[dict] = []
    cur: dict = {}
    real_cache, real_update = kt.KVTier.cache, tc.KvtierCache.update

    def cache(self, token_ids):
        sync()
        t0 = time.perf_counter()
        c = real_cache(self, token_ids)
        sync()
        cur.clear()
        cur.update(cache_s=time.perf_counter() - t0, update_s=0.0, updates=0,
                   plan=c.plan.as_dict() if c.plan is not None else None)
        calls.append(cur.copy())
        c._probe = len(calls) - 1
        return c

    def update(self, *x, **y):
        t0 = time.perf_counter()
        try:
            return real_update(self, *x, **y)
        finally:
            i = getattr(self, "_probe", None)
            if i is not None:
                calls[i]["update_s"] += time.perf_counter() - t0
                calls[i]["updates"] += 1

    kt.KVTier.cache, tc.KvtierCache.update = cache, update
    try:
        out = wt.run(device=device, n_conv=3, turns=3, seed=a.seed, store_dir=None, keep=False, quiet=True, cluster=None,
                     window=window)
    finally:
        kt.KVTier.cache, tc.KvtierCache.update = real_cache, real_update
    # calls made by the workload's requests are the last len(results) of them (calibration made the others)
    rows = []
    reqs = out["results"]
    for r, c in zip(reqs, calls[-len(reqs):]):
        rows.append(dict(request=r["request"], source=r["source"], plan=r["plan"], tokens=r["tokens"],
                         kvtier_ms=1e3 * r["ttft_s"], no_tier_ms=1e3 * r["no_tier_s"],
                         predicted_ms=1e3 * r["predicted_s"] if r["predicted_s"] else None,
                         cache_ms=1e3 * c["cache_s"], update_host_ms=1e3 * c["update_s"], updates=c["updates"]))
        print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
    with open(a.out, "w") as f:
        json.dump(dict(device=device, window=out["window"], rows=rows, prefill=out["prefill"], measured=out["measured"]), f, indent=1,
                  default=str)


if __name__ == "__main__":
    main()
