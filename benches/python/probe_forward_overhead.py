"""Where a forward through kvtier's transformers cache spends the time it takes over transformers' own
DynamicCache, layer by layer, on the host: every cache ``update`` call's entry and exit are stamped (no
profiler: its own overhead hides what this looks for), for the same tokens through

- ``floor``: a DynamicCache that already holds the prefix on the device (what no restore can beat);
- ``kvtier``: a KvtierCache whose prefix was restored from the host pool just before (its loads in flight);
- ``kvtier-settled``: the same, with the restore's loads finished before the forward starts;

each as a prefill of ``--suffix`` tokens on ``--ctx`` cached ones and as one decode step after it. Also the
host time inside the cache's last-layer work (the forward's backups, the adoption of its pages), and for
``floor-dma``: the floor with the prefix's bytes copied host -> device on another stream beside it (does a
copy in flight slow the launches?). Prints and writes medians of ``--reps``.

    PYTHONPATH=python python benches/python/probe_forward_overhead.py [--ctx 3136] [--suffix 576] [--out o.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_restore_forward import setup  # noqa: E402

from kvtier.integrations.transformers import KVTier  # noqa: E402
from kvtier.integrations.transformers import cache as tc  # noqa: E402
from kvtier.integrations.transformers import state as ts  # noqa: E402
from kvtier.integrations.transformers import window as tw  # noqa: E402

STAMPS: list[tuple[str, float]] = []


def stamped(owner: Any, name: str, tag: str) -> tuple[Any, str, Any]:
    real = owner.__dict__[name]

    def wrapper(*a: Any, **k: Any) -> Any:
        STAMPS.append((tag + ">", time.perf_counter()))
        try:
            return real(*a, **k)
        finally:
            STAMPS.append((tag + "<", time.perf_counter()))

    setattr(owner, name, wrapper)
    return owner, name, real


def summary(stamps: list[tuple[str, float]], t0: float, t_cpu: float, t_end: float) -> dict:
    """Per-layer host timeline of one forward from its stamps."""
    ins = [t for tag, t in stamps if tag == "update>"]
    outs = [t for tag, t in stamps if tag == "update<"]
    row: dict = {"wall_ms": 1e3 * (t_end - t0), "cpu_return_ms": 1e3 * (t_cpu - t0), "layers": len(ins)}
    if ins:
        periods = [b - a for a, b in zip(ins, ins[1:])]
        inside = [b - a for a, b in zip(ins, outs)]
        row.update(before_first_ms=1e3 * (ins[0] - t0), after_last_ms=1e3 * (t_cpu - outs[-1]),
                   period_median_ms=1e3 * statistics.median(periods) if periods else 0.0,
                   period_first_ms=1e3 * periods[0] if periods else 0.0,
                   period_last_ms=1e3 * periods[-1] if periods else 0.0,
                   update_median_ms=1e3 * statistics.median(inside), update_first_ms=1e3 * inside[0],
                   update_last_ms=1e3 * inside[-1], update_sum_ms=1e3 * sum(inside))
    for tag in ("flush", "adopt", "fence", "joined", "wait", "transfer_layers"):
        spans, open_at = [], None
        for t, at in stamps:
            if t == tag + ">":
                open_at = at
            elif t == tag + "<" and open_at is not None:
                spans.append(at - open_at)
                open_at = None
        if spans:
            row[f"{tag}_sum_ms"] = 1e3 * sum(spans)
            row[f"{tag}_calls"] = len(spans)
    return row


def med(rows: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0] if all(k in r for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=3136)
    ap.add_argument("--suffix", type=int, default=576)
    ap.add_argument("--ps", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU (a check of the script)")
    ap.add_argument("--no-cudnn", action="store_true")
    ap.add_argument("--out", default="forward-overhead.json")
    a = ap.parse_args()
    dev, cuda, model, cfg, kw, sync = setup(a.tiny, a.no_cudnn)
    ctx, suffix, ps = a.ctx, a.suffix, a.ps
    gen = torch.Generator().manual_seed(5)
    base = torch.randint(0, cfg.vocab_size, (1, ctx), generator=gen)
    undo = [stamped(Cache, "update", "update"), stamped(tc.KvtierCache, "update", "update"),
            stamped(tw.LayerBatch, "flush", "flush"), stamped(tc.KvtierCache, "_adopt", "adopt"),
            stamped(ts.TierRuntime, "fence", "fence"), stamped(ts.TierRuntime, "_joined", "joined"),
            stamped(ts.TierRuntime, "transfer_layers", "transfer_layers")]
    wait_real = ts.TierRuntime.__dict__["wait"].__func__

    def wait(stream: Any, pending: Any) -> None:
        STAMPS.append(("wait>", time.perf_counter()))
        try:
            wait_real(stream, pending)
        finally:
            STAMPS.append(("wait<", time.perf_counter()))

    ts.TierRuntime.wait = staticmethod(wait)  # type: ignore[method-assign]
    rows: dict[str, dict[str, list[dict]]] = {}

    def timed(name: str, ids: torch.Tensor, cache: Any, phase: str) -> None:
        sync()
        STAMPS.clear()
        t0 = time.perf_counter()
        model(input_ids=ids.to(dev), use_cache=True, logits_to_keep=1, **{kw: cache})
        t_cpu = time.perf_counter()
        sync()
        t_end = time.perf_counter()
        rows.setdefault(name, {}).setdefault(phase, []).append(summary(list(STAMPS), t0, t_cpu, t_end))

    try:
        with torch.no_grad():
            kept = DynamicCache(config=cfg)
            model(input_ids=base.to(dev), use_cache=True, logits_to_keep=1, **{kw: kept})
            side = torch.cuda.Stream() if cuda else None
            pinned = torch.empty(ctx * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * 128, dtype=torch.bfloat16,
                                 pin_memory=cuda)
            target = torch.empty_like(pinned, device=dev)
            tier = KVTier(model, model_id="probe/forward-overhead", page_size=ps, window="auto",
                          host_tokens=2 * (ctx + suffix + 1) + 8 * ps, restore="all")
            first = tier.cache(base)
            model(input_ids=base.to(dev), use_cache=True, logits_to_keep=1, **{kw: first})
            first.release()
            tier.controller.wait_idle()
            for rep in range(a.reps + 1):
                new = torch.randint(0, cfg.vocab_size, (1, suffix), generator=gen)
                nxt = torch.randint(0, cfg.vocab_size, (1, 1), generator=gen)
                ids = torch.cat([base, new], 1)
                for name in ("floor", "floor-dma", "kvtier", "kvtier-settled"):
                    if name.startswith("floor"):
                        c = copy.deepcopy(kept)
                        if name == "floor-dma" and side is not None:
                            sync()
                            with torch.cuda.stream(side):
                                target.copy_(pinned, non_blocking=True)
                        timed(name, new, c, "prefill")
                        timed(name, nxt, c, "decode")
                        del c
                        continue
                    ids = torch.cat([base, torch.randint(0, cfg.vocab_size, (1, suffix), generator=gen)], 1)
                    new = ids[:, ctx:]  # (a suffix of its own: no earlier forward adopted its pages)
                    sync()
                    t0 = time.perf_counter()
                    c = tier.cache(ids)
                    t1 = time.perf_counter()
                    assert c.restored_tokens == ctx, (c.restored_tokens, ctx)
                    if name == "kvtier-settled":
                        tier.synchronize()
                        sync()
                    timed(name, new, c, "prefill")
                    rows[name]["prefill"][-1]["cache_ms"] = 1e3 * (t1 - t0)
                    timed(name, nxt, c, "decode")
                    c.release()
                    tier.controller.wait_idle()
                if rep == 0:  # warm-up
                    rows.clear()
            tier.close()
    finally:
        for owner, name, real in undo:
            setattr(owner, name, real)
        ts.TierRuntime.wait = staticmethod(wait_real)  # type: ignore[method-assign]
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "ctx": ctx, "suffix": suffix,
           "reps": a.reps, "rows": {n: {p: med(v) for p, v in ph.items()} for n, ph in rows.items()}}
    for n, ph in out["rows"].items():
        for p, r in ph.items():
            print(f"{n:15s} {p:8s} " + " ".join(f"{k}={v}" for k, v in r.items()), flush=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
