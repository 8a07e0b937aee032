"""Part (b) of bench_transformers.py: time to first token of a prompt whose prefix was seen before, against
recomputing it, for every way kvtier can restore it — in one run, on one model.

Rows (each TTFT the median of REPS runs after a first that warms the kernels up and lets the tier measure itself):
- ``recompute``: transformers prefills the whole prompt (DynamicCache); ``gpu_copy``: transformers reuses a
  prefix DynamicCache kept on the GPU (deep-copied).
- ``kvtier_host`` / ``kvtier_disk``: every cached page loaded (``restore="all"``) from the pinned host pool,
  or from the PageStore (host copies dropped first) — what kvtier did before it planned restores.
- ``planned_host`` / ``planned_disk``: the same with the restore planner (``restore="plan"``): from the disk it
  may recompute the head of the prefix while the tail loads.
- ``planned_mixed``: a prefix whose first third is on the host, second third only on the disk, and last
  third never seen (recomputed): the planner's choice reported.
- ``planned_slow``: the disk's reads throttled to ``--slow-gbps`` (default 0.3 GB/s, by sleeping after each
  real read batch: the store measures the throttled rate); the planner must not be slower than recompute.

Checks: restored logits equal ``gpu_copy``'s bit for bit where every reused page was loaded; every row picks
recompute's token, or ``gpu_copy``'s where transformers' own reuse of the prefix picks another than recompute
(``gpu_copy_same_token_as_recompute`` false: the two forwards' shapes round differently, and near-tied logits
of a random-weights model can flip); the pages a planned row loaded are the stored bytes (layers 0 and last).
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch
from transformers import DynamicCache

SUFFIX = 64
#: each time is the median of REPS runs after one warm-up run (a single run scatters by ±30 % on the H200)
REPS = 5


class Throttled:
    """A PageStore's native store whose reads run at most ``gbps`` (sleeps after each real batch)."""

    def __init__(self, native: Any, page_bytes: int, gbps: float) -> None:
        self._native, self._page_bytes, self._gbps = native, page_bytes, gbps

    def get_pages(self, keys: Any, idx: Any, layers: int = 0, first: int = 0, gate: Any = None) -> Any:
        t0 = time.perf_counter()
        # a read in two passes (a split restore's, every layer resident): the real disk reads both at once, and
        # the caller's gate opens when the throttled read would have read the first layers
        ok = self._native.get_pages(keys, idx, layers, first, None) if layers else self._native.get_pages(keys, idx)
        want = sum(ok) * self._page_bytes / (self._gbps * 1e9)
        if gate is not None:
            time.sleep(max(0.0, want * first / layers - (time.perf_counter() - t0)))
            gate.open()
        time.sleep(max(0.0, want - (time.perf_counter() - t0)))
        return ok

    def __getattr__(self, name: str) -> Any:
        return getattr(self._native, name)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _first_token(device: str) -> None:
    """Where a time to first token ends: the first token's logits are done (the model's stream, which waited for
    every load they need). kvtier's backups of the new pages still running on its transfer stream are not in it
    (a server sends the token meanwhile); the device is synchronized after each timing, untimed."""
    if device == "cuda":
        torch.cuda.current_stream().synchronize()


@torch.no_grad()
def _first(model: Any, ids: torch.Tensor, cache: Any, kwarg: str) -> torch.Tensor:
    return model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kwarg: cache}).logits[:, -1]


def _pages_kv(cache: Any, layers: list[int], first: int, last: int, ps: int) -> list[torch.Tensor]:
    """Host K and V of pages [first, last) of ``cache`` for ``layers`` (copies)."""
    out = []
    for layer in layers:
        k, v = cache.host_kv(layer, last * ps)
        out += [k[:, :, first * ps:].clone(), v[:, :, first * ps:].clone()]
    return out


def run(model: Any, tier: Any, contexts: list[int], vocab: int, device: str, ps: int, kwarg: str,
        slow_gbps: float) -> dict:
    results: dict = {}
    for i, ctx in enumerate(contexts):
        row: dict = {}
        try:
            _context(row, model, tier, ctx, i, vocab, device, ps, kwarg, slow_gbps)
        except Exception as exc:  # noqa: BLE001 - one failing context must not lose the others
            row["error"] = repr(exc)
        results[ctx] = row
        _print(ctx, row)
    return results


def _context(row: dict, model: Any, tier: Any, ctx: int, i: int, vocab: int, device: str, ps: int, kwarg: str,
             slow_gbps: float) -> None:
    from kvtier.planner import TierMeter

    cfg = model.config
    layers = [0, cfg.num_hidden_layers - 1]
    base = torch.randint(0, vocab, (1, ctx + 2 * SUFFIX), generator=torch.Generator().manual_seed(10 + i))
    seen = base[:, : ctx + SUFFIX]  # served first: its prefix pages are kept
    new = torch.cat([base[:, :ctx], base[:, ctx + SUFFIX:]], 1)
    n = ctx // ps * ps

    def timed(fn: Any) -> tuple[float, Any]:
        out, dts = None, []
        for _ in range(REPS + 1):
            _sync(device)
            t0 = time.perf_counter()
            out = fn()
            _first_token(device)
            dts.append(time.perf_counter() - t0)
        _sync(device)
        return statistics.median(dts[1:]), out

    row["recompute_s"], rec = timed(lambda: _first(model, new.to(device), DynamicCache(config=cfg), kwarg))
    kept = DynamicCache(config=cfg)
    _first(model, seen.to(device), kept, kwarg)
    kept.crop(n - seen.shape[1])
    row["gpu_copy_s"], ref = timed(lambda: _first(model, new[:, n:].to(device), copy.deepcopy(kept), kwarg))
    row["gpu_copy_same_token_as_recompute"] = bool(torch.equal(ref.argmax(-1), rec.argmax(-1)))
    tier.calibrate([ctx // 4, ctx // 2, ctx])  # the planner's prefill model, at this prompt's lengths
    first = tier.cache(seen)
    _first(model, seen.to(device), first, kwarg)
    stored = _pages_kv(first, layers, 0, n // ps, ps)
    first.release()
    tier.controller.wait_idle()  # its pages are in the store: no disk writes during the timings

    def restore(mode: str, drop: bool) -> tuple[float, Any]:
        tier.restore = mode
        dts = []
        for rep in range(REPS + 1):
            if drop:
                tier.drop_host_copies()
            _sync(device)
            t0 = time.perf_counter()
            cache = tier.cache(new)
            got = _first(model, new[:, cache.get_seq_length():].to(device), cache, kwarg)
            _first_token(device)
            dts.append(time.perf_counter() - t0)
            _sync(device)
            if rep < REPS:
                cache.release()
                tier.controller.wait_idle()
        return statistics.median(dts[1:]), (cache, got)

    def record(name: str, dt: float, cache: Any, got: torch.Tensor) -> None:
        plan = cache.plan
        row[f"{name}_s"] = dt
        row[f"{name}_ratio"] = dt / row["recompute_s"]
        row[f"{name}_window"] = cache.resident_layers
        row[f"{name}_pages"] = dict(host=cache.restored_host_pages, store=cache.restored_store_pages,
                                    recomputed_head_tokens=cache.recomputed_tokens)
        row[f"{name}_same_token_as_recompute"] = bool(torch.equal(got.argmax(-1), rec.argmax(-1)))
        # the token of the whole prompt's forward, or of transformers' own reuse of the prefix (gpu_copy): where
        # those two differ (the shapes of the two forwards round differently) a restore may give either
        row[f"{name}_token_of_recompute_or_reuse"] = row[f"{name}_same_token_as_recompute"] or bool(
            torch.equal(got.argmax(-1), ref.argmax(-1)))
        row[f"{name}_max_abs_diff_vs_recompute"] = float((got.float() - rec.float()).abs().max())
        if plan is None or (plan.kind in ("load", "host") and plan.reused_pages == n // ps):
            row[f"{name}_exact_vs_gpu_copy"] = bool(torch.equal(got, ref))
        if plan is not None:
            row[f"{name}_plan"] = plan.as_dict()
            row[f"{name}_predicted_s"] = plan.predicted_s
            # the loaded pages the first prompt stored (a page past its prefix, [n, ...), was stored by an earlier
            # row's run of this prompt: no reference here) against the bytes that prompt computed
            last = min(plan.load_to, n // ps)
            if last > plan.recompute_to:
                loaded = _pages_kv(cache, layers, plan.recompute_to, last, ps)
                want = [t[:, :, (plan.recompute_to * ps):(last * ps)] for t in stored]
                row[f"{name}_loaded_pages_bit_identical"] = all(torch.equal(a, b) for a, b in zip(loaded, want))
        cache.release()
        tier.controller.wait_idle()

    for name, mode, drop in (("kvtier_host", "all", False), ("kvtier_disk", "all", True),
                             ("planned_host", "plan", False), ("planned_disk", "plan", True)):
        dt, (cache, got) = restore(mode, drop)
        record(name, dt, cache, got)
    # host + disk + never seen in one prefix: the first third back on the host, the second only on the disk, the
    # last third new (each run: host copies dropped, the first third read back, a tail of its own)
    third = n // ps // 3 * ps
    mixed_s: dict[str, list[float]] = {"recompute": [], "planned": []}
    for rep in range(REPS):
        tier.restore = "all"
        tier.drop_host_copies()
        warm = tier.cache(new[:, : third + 1])  # reads the first third from the disk into the host pool
        warm.release()
        tier.controller.wait_idle()
        tail = torch.randint(0, vocab, (1, new.shape[1] - 2 * third), generator=torch.Generator().manual_seed(99 + rep))
        mixed = torch.cat([new[:, : 2 * third], tail], 1)
        _sync(device)
        t0 = time.perf_counter()
        _first(model, mixed.to(device), DynamicCache(config=cfg), kwarg)
        _first_token(device)
        mixed_s["recompute"].append(time.perf_counter() - t0)
        tier.restore = "plan"
        _sync(device)
        t0 = time.perf_counter()
        cache = tier.cache(mixed)
        _first(model, mixed[:, cache.get_seq_length():].to(device), cache, kwarg)
        _first_token(device)
        mixed_s["planned"].append(time.perf_counter() - t0)
        _sync(device)
        row["mixed_recompute_s"] = statistics.median(mixed_s["recompute"])
        row["planned_mixed_s"] = statistics.median(mixed_s["planned"])
        row["planned_mixed_ratio"] = row["planned_mixed_s"] / row["mixed_recompute_s"]
        row["planned_mixed_plan"] = cache.plan.as_dict() if cache.plan else None
        row["planned_mixed_predicted_s"] = cache.plan.predicted_s if cache.plan else None
        cache.release()
        tier.controller.wait_idle()
    # a slow disk: reads throttled; the store's meter learns it from its own batches
    store = tier.page_store
    native, meter = store._native, store.meter
    store._native = Throttled(native, store.page_bytes, slow_gbps)
    store.meter = TierMeter("disk")
    store.meter.seed(read_GBps=slow_gbps)  # (the probe at open measures the real disk, not the throttle)
    try:
        dt, (cache, got) = restore("plan", True)
        record("planned_slow", dt, cache, got)
        row["planned_slow_measured_read_GBps"] = store.meter.estimate().read_GBps
    finally:
        store._native, store.meter = native, meter
    tier.restore = "plan"


def _print(ctx: int, row: dict) -> None:
    if "error" in row:
        print(f"  prefix {ctx}: FAILED {row['error']}", flush=True)
        return

    def cell(name: str) -> str:
        plan = row.get(f"{name}_plan")
        kind = f" {plan['kind']}" if plan else ""
        return f"{1e3 * row[f'{name}_s']:7.1f} ms ({row[f'{name}_ratio']:.2f}x{kind})"

    print(f"  prefix {ctx:>6}: recompute {1e3 * row['recompute_s']:7.1f} ms | gpu_copy {1e3 * row['gpu_copy_s']:6.1f} ms"
          f" | all pages: host {cell('kvtier_host')}, disk {cell('kvtier_disk')}"
          f" | planned: host {cell('planned_host')}, disk {cell('planned_disk')}, slow {cell('planned_slow')},"
          f" mixed {cell('planned_mixed')}", flush=True)
