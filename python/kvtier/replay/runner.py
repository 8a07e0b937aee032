"""One replay configuration: a trace served by kvtier's real tiers and by the LRU model, request by request.

Nodes: ``separate`` gives each node its own PageStore; ``shared`` gives every node one PageStore; a cluster
run gives every node a Mooncake client of one cluster tier (:mod:`kvtier.replay.cluster`). Each
node has its own host tier either way. A request goes to one node: ``random`` (seeded; the same draw for kvtier
and the model) or ``prefix``, SGLang's router's cache-aware rule without its load thresholds: the node whose
tiers hold the longest prefix of the request if that prefix is at least :data:`CACHE_THRESHOLD` of its blocks,
else the node that has served the fewest requests (ties: fewest served, then the lowest index; each side
decides from its own tiers). Longest-prefix alone would send every request to one node in a trace whose
requests all begin with the same block (the conversation trace's do).
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvtier.planner import PrefillModel, TierEstimate, plan_restore

from .._cleanup import remove_tree
from .._errors import KvtierError
from .cluster import ClusterRun
from .model import LruTier, ModelNode
from .tiers import KvtierNode, SharedStore, open_dir
from .trace import BLOCK_TOKENS, Request


@dataclass
class Setup:
    host_pages: int
    page_bytes: int
    bytes_per_token: int
    prefill_tokens_per_s: float
    root: str  # where the stores' directories are made
    key_len: int
    batch_pages: int  # most blocks of one request
    assumed_gbps: dict[str, float] = field(default_factory=dict)  # tier -> read GB/s for the planner


@dataclass
class Side:
    """Hit tokens and costs of one side (kvtier or the model) over a run."""

    host_tokens: int = 0
    store_tokens: int = 0
    seconds: float = 0.0

    def pct(self, tokens: int, total: int) -> float:
        return 100.0 * tokens / total if total else 0.0


class _Progress:
    """Requests done / total and the rate, on stderr every few seconds (in place on a terminal)."""

    def __init__(self, total: int, label: str, every_s: float = 2.0) -> None:
        self.total, self.label, self.every = total, label, every_s
        self.t0 = self.last = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.shown = False

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if now - self.last < self.every and done < self.total:
            return
        if not self.shown and done >= self.total:
            return  # a run quicker than one interval prints nothing
        self.last, self.shown = now, True
        rate = done / (now - self.t0) if now > self.t0 else 0.0
        left = (self.total - done) / rate if rate else math.inf
        start, end = ("\r", "  ") if self.tty else ("", "\n")
        sys.stderr.write(
            f"{start}replay {self.label}: {done}/{self.total} requests, {rate:.0f} req/s, {left:.0f} s left{end}"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.shown and self.tty:
            sys.stderr.write("\n")


#: the share of a request's blocks a node must hold for prefix routing to send the request there
CACHE_THRESHOLD = 0.5


def _route(scores: list[int], blocks: int, served: list[int]) -> int:
    best = min(range(len(scores)), key=lambda i: (-scores[i], served[i], i))
    if scores[best] >= CACHE_THRESHOLD * blocks:
        return best
    return min(range(len(scores)), key=lambda i: (served[i], i))


def run(
    reqs: list[Request],
    setup: Setup,
    *,
    nodes: int,
    store_pages: int | None,
    shared: bool,
    routing: str,
    seed: int,
    label: str,
    cluster_memory: int | None = None,
) -> dict[str, Any]:
    """Replays ``reqs`` through ``nodes`` nodes whose store holds ``store_pages`` pages each (``shared``: one
    store of ``store_pages`` for all; ``cluster_memory``: one Mooncake cluster tier of that many bytes for all,
    instead of a PageStore); returns the row the report prints."""
    sh = None
    cl: ClusterRun | None = None
    kv: list[KvtierNode] = []
    try:
        if cluster_memory is not None:
            cl = ClusterRun(cluster_memory, setup.page_bytes).__enter__()
            kv = []
            for _ in range(nodes):
                kv.append(KvtierNode(setup.host_pages, setup.page_bytes, setup.prefill_tokens_per_s, cluster=cl.tier))
            model = [ModelNode(setup.host_pages, cl.model) for _ in range(nodes)]
        elif shared:
            sh = SharedStore(
                open_dir(setup.root, f"{label}-shared"), store_pages, setup.page_bytes, setup.key_len, setup.batch_pages
            )
            kv = [
                KvtierNode(setup.host_pages, setup.page_bytes, setup.prefill_tokens_per_s, shared=sh)
                for _ in range(nodes)
            ]
            common = LruTier(store_pages)
            model = [ModelNode(setup.host_pages, common) for _ in range(nodes)]
        else:
            kv = [
                KvtierNode(
                    setup.host_pages,
                    setup.page_bytes,
                    setup.prefill_tokens_per_s,
                    store_dir=open_dir(setup.root, f"{label}-node{i}"),
                    store_pages=store_pages,
                    key_len=setup.key_len,
                )
                for i in range(nodes)
            ]
            model = [ModelNode(setup.host_pages, LruTier(store_pages)) for _ in range(nodes)]
        row = _replay(reqs, setup, kv, model, sh, routing, seed, label, cl)
        if cl is not None:
            row["cluster_memory_bytes"] = cluster_memory
        return row
    finally:
        for node in kv:
            node.close()
        if sh is not None:
            sh.close()
        if cl is not None:
            cl.close()
        for d in os.listdir(setup.root):  # this run's stores: the next run starts from empty disks
            if d.startswith(f"{label}-"):
                remove_tree(os.path.join(setup.root, d))


def _replay(
    reqs: list[Request],
    setup: Setup,
    kv: list[KvtierNode],
    model: list[ModelNode],
    sh: SharedStore | None,
    routing: str,
    seed: int,
    label: str,
    cl: ClusterRun | None,
) -> dict[str, Any]:
    n_nodes = len(kv)
    tier = "mooncake" if cl is not None else "disk"
    rng = random.Random(seed)
    served_kv, served_model = [0] * n_nodes, [0] * n_nodes
    a, b = Side(), Side()
    total = 0
    differ = 0
    prefill = PrefillModel.fixed(setup.prefill_tokens_per_s)
    model_page_bytes = setup.bytes_per_token * BLOCK_TOKENS
    ttft_recompute = ttft_planned = 0.0
    kinds: Counter[str] = Counter()
    tiers: dict[str, TierEstimate] = {}
    progress = _Progress(len(reqs), label)
    for i, r in enumerate(reqs):
        ids = r.hash_ids
        if routing == "random" or n_nodes == 1:
            j = jm = rng.randrange(n_nodes) if n_nodes > 1 else 0
        t0 = time.perf_counter()
        if routing == "prefix" and n_nodes > 1:
            keys = [f"{h:x}" for h in ids]
            j = _route([node.peek(keys) for node in kv], len(ids), served_kv)
        n, m = kv[j].serve(ids)
        t1 = time.perf_counter()
        if routing == "prefix" and n_nodes > 1:
            jm = _route([node.peek(ids) for node in model], len(ids), served_model)
        mn, mm = model[jm].serve(ids)
        t2 = time.perf_counter()
        a.seconds += t1 - t0
        b.seconds += t2 - t1
        served_kv[j] += 1
        served_model[jm] += 1
        differ += (n, m) != (mn, mm)
        L = r.input_length
        for side, h, s in ((a, n, m), (b, mn, mm)):
            host = min(h * BLOCK_TOKENS, L)
            side.host_tokens += host
            side.store_tokens += min((h + s) * BLOCK_TOKENS, L) - host
        total += L
        if i % 64 == 0:
            tiers = _tiers(kv[j], setup.assumed_gbps)
        plan = plan_restore(
            prompt_tokens=L,
            page_tokens=BLOCK_TOKENS,
            page_bytes=model_page_bytes,
            host_pages=n,
            store_segments=[(tier, m)] if m else [],
            tiers=tiers,
            prefill=prefill,
            can_split=True,
        )
        ttft_recompute += plan.recompute_s or 0.0
        ttft_planned += plan.predicted_s or 0.0
        kinds[plan.kind] += 1
        progress.update(i + 1)
    progress.close()
    wrong = sum(node.wrong_pages for node in kv)
    if wrong:
        raise KvtierError(f"replay {label}: {wrong} page(s) came back from a store with another block's bytes")
    st = [node.ctl.stats for node in kv]
    model_stores = list({id(node.store): node.store for node in model}.values())
    read_misses = None
    if cl is not None:
        held, evicted = cl.held()
        tier_stats = [node.cluster_tier.get_stats() for node in kv]
        # pages a lookup found that the read then did not deliver (evicted in between, a failed check)
        read_misses = sum(int(t["misses"]) for t in tier_stats)
    else:
        stores = [sh.store] if sh is not None else [node.own_store for node in kv]
        store_stats = [s.get_stats() for s in stores if s is not None]
        held = sum(int(s["pages"]) for s in store_stats)
        evicted = sum(int(s["evictions"]) // 2 for s in store_stats)
    est = tiers.get(tier)
    scale = setup.bytes_per_token * BLOCK_TOKENS / setup.page_bytes
    moved = {
        "host_hit_bytes": sum(s.host_hit_pages for s in st) * setup.page_bytes,
        f"{tier}_read_bytes": sum(s.bytes_from_store for s in st),
        f"{tier}_written_bytes": sum(s.bytes_to_store for s in st),
    }
    return {
        "label": label,
        "nodes": n_nodes,
        "requests": len(reqs),
        "input_tokens": total,
        "store_tier": tier,
        "store_pages": model[0].store.capacity,
        "kvtier": {
            "hit_pct": a.pct(a.host_tokens + a.store_tokens, total),
            "host_pct": a.pct(a.host_tokens, total),
            "store_pct": a.pct(a.store_tokens, total),
            "ms_per_request": 1e3 * a.seconds / len(reqs),
            "store_pages_held": held,
            "store_evictions": evicted,
            "host_evictions": sum(s.host_evictions for s in st),
            "store_read_misses": read_misses,
        },
        "model": {
            "hit_pct": b.pct(b.host_tokens + b.store_tokens, total),
            "host_pct": b.pct(b.host_tokens, total),
            "store_pct": b.pct(b.store_tokens, total),
            "ms_per_request": 1e3 * b.seconds / len(reqs),
            "store_pages_held": sum(len(s.pages) for s in model_stores),
            "store_evictions": sum(s.evictions for s in model_stores),
            "host_evictions": sum(node.evictions for node in model),
        },
        "requests_differing": differ,
        "moved": moved,
        "moved_scaled": {k: int(v * scale) for k, v in moved.items()},
        "ttft": {
            "recompute_mean_s": ttft_recompute / len(reqs),
            "planned_mean_s": ttft_planned / len(reqs),
            "plans": dict(kinds),
            "store_read_GBps": est.read_GBps if est else None,
            "store_source": est.source if est else None,
        },
        "served_per_node": served_kv,
    }


def _tiers(node: KvtierNode, assumed: dict[str, float]) -> dict[str, TierEstimate]:
    """The tiers' figures for the planner: measured by kvtier (probe, then its own batches), or assumed."""
    out = dict(node.ctl.measured())
    for name, gbps in assumed.items():
        out[name] = TierEstimate(name=name, read_GBps=gbps, source="assumed")
    return out
