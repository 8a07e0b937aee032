"""Replays a request trace (Mooncake FAST'25 format) through kvtier's real tiers and an exact LRU model of them.

    kvtier replay --trace conversation [--capacities 1M,3M,10M,50M,inf] [--host-tokens 256K]
                        [--page-bytes 16K] [--limit N] [--out DIR] [--plot hit.png]
    kvtier replay --trace synthetic --nodes 10 --routing prefix --capacities 3M
    kvtier replay --trace conversation --cluster --page-bytes 8K [--nodes 10 --routing prefix]

Each request looks up the longest prefix of its blocks (host first, then the store), counts the hit tokens
of each tier, brings the store's part into the host and writes the blocks it missed through to the store
(kvtier.replay.model lists the steps). One block is one page of ``--page-bytes`` really stored;
hit rates are in tokens, and bytes moved are given as moved and scaled to the model's geometry
(``--bytes-per-token``, default LLaMA3-70B's 320 KB, the paper's). The planner (kvtier.planner.plan_restore)
predicts each request's time to first token with the tiers' measured read rates (or ``--read-gbps``) and
a fixed prefill rate. The model runs in the same loop; a hit rate (or a tier's share) more than
``--tolerance`` points from the model's fails the command.

With ``--nodes N`` the trace is replayed twice per capacity C: N nodes with a store of C each (separate),
and N nodes sharing one store of N×C (the paper's 10 prefill nodes pooling their 3M tokens each); each node
has its own host tier. The shared tier is one shared PageStore, or with ``--cluster`` the Mooncake cluster tier.

``--cluster``: the store behind each node's host tier is the Mooncake cluster tier (a LocalCluster on
127.0.0.1 started for each configuration and stopped after it, every node a MooncakeTier client of it), as
SGLang's HiCache deploys it (its L3 storage backend, with no disk of the node's own between). The model
holds Mooncake's own eviction rule (kvtier.replay.cluster and model.ClusterLru). With
``--nodes`` the separate stores stay PageStores (each node's own 3M) and the shared one is the cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

from .._cleanup import remove_tree
from .._errors import KvtierError
from ..config import parse_size
from . import trace as tr
from .options import parser
from ._output import check_plot_path, out_dir, write_results
from .cluster import cluster_memory
from .model import one_lru_pct
from .report import disagreements, nodes_table, plot, sweep_table
from .runner import Setup, run



def _setup(a: argparse.Namespace, trace: tr.Trace, root: str) -> Setup:
    page_bytes = parse_size("--page-bytes", a.page_bytes, 1)
    if page_bytes % 8192:
        raise KvtierError(
            f"--page-bytes {a.page_bytes}: must be a multiple of 8K (K and V halves in whole 4 KiB "
            "blocks, as O_DIRECT needs)"
        )
    host = tr.blocks_of(tr.parse_tokens("--host-tokens", a.host_tokens))
    if host is None or host < 2:
        raise KvtierError(f"--host-tokens {a.host_tokens}: give a finite size of at least 2 blocks (1024 tokens)")
    assumed = {}
    if a.read_gbps:
        for item in a.read_gbps.split(","):
            name, _, value = item.partition("=")
            try:
                assumed[name.strip()] = float(value)
            except ValueError:
                raise KvtierError(f"--read-gbps: {item!r} is not TIER=GBPS (e.g. disk=6)") from None
            if not assumed[name.strip()] > 0 or name.strip() not in ("disk", "mooncake"):
                raise KvtierError(f"--read-gbps: {item!r}: the tier is disk or mooncake and the rate a number > 0")
    ids = [h for r in trace.requests for h in r.hash_ids]
    return Setup(
        host_pages=host,
        page_bytes=page_bytes,
        bytes_per_token=parse_size("--bytes-per-token", a.bytes_per_token, 1),
        prefill_tokens_per_s=a.prefill_tokens_per_s,
        root=root,
        key_len=len(f"{max(ids, default=0):x}"),
        batch_pages=max(len(r.hash_ids) for r in trace.requests),
        assumed_gbps=assumed,
    )


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    if a.nodes < 1 or a.nodes > 64:
        raise KvtierError(f"--nodes must be in [1, 64], got {a.nodes}")
    if a.limit is not None and a.limit < 1:
        raise KvtierError(f"--limit must be at least 1, got {a.limit}")
    if not a.prefill_tokens_per_s > 0:
        raise KvtierError(f"--prefill-tokens-per-s must be > 0, got {a.prefill_tokens_per_s}")
    caps = [
        tr.parse_tokens("--capacities", c)
        for c in (a.capacities or ("3M" if a.nodes > 1 else "1M,3M,10M,50M,inf")).split(",")
    ]
    check_plot_path(a.plot)
    if a.cluster:
        from ..tiers._mooncake_env import binary, store_class

        try:  # Mooncake missing is one clear error before any replay
            store_class()
            binary("mooncake_master")
        except (KvtierError, ImportError, OSError) as exc:
            raise KvtierError(f"--cluster: the Mooncake cluster tier is not available here: {exc}") from None
    out = out_dir(a.out)
    trace = tr.load(a.trace, a.limit)
    created = a.dir is not None and not os.path.exists(a.dir)
    try:
        root = a.dir or tempfile.mkdtemp(prefix="kvtier-bench-replay-", dir=os.getcwd())
        os.makedirs(root, exist_ok=True)
    except OSError as exc:
        raise KvtierError(f"cannot create the bench directory ({exc}); pass --dir") from None
    try:
        setup = _setup(a, trace, root)
        result = _bench(a, trace, setup, caps)
    finally:
        if a.dir is None or created:
            remove_tree(root)
    if out is not None:
        _save(out, result)
    if a.plot and a.nodes == 1:
        plot(a.plot, result["rows"], result["best_pct"], f"{result['trace']} ({len(trace.requests)} requests)")
        print(f"plot in {a.plot}")
    if result["disagreements"]:
        raise KvtierError("kvtier and the LRU model DISAGREE:\n  " + "\n  ".join(result["disagreements"]))


def _bench(a: argparse.Namespace, trace: tr.Trace, setup: Setup, caps: list[float]) -> dict[str, Any]:
    reqs = trace.requests
    name = trace.known or os.path.basename(trace.path)
    pairs = [(r.input_length, r.hash_ids) for r in reqs]
    best = one_lru_pct(pairs, None)
    print(
        f"trace {trace.path} ({name}, sha256 {trace.sha256[:16]}…): {len(reqs)} requests, "
        f"{sum(r.input_length for r in reqs)} input tokens; best possible hit rate (unlimited cache) {best:.2f}%"
    )
    store = "Mooncake cluster tier (LocalCluster)" if a.cluster else "PageStore"
    print(
        f"tiers: host {setup.host_pages} blocks ({setup.host_pages * tr.BLOCK_TOKENS} tokens) per node; store: "
        f"{store}, {setup.page_bytes} B per block really stored (scaled x{setup.bytes_per_token * 512 // setup.page_bytes} "
        f"to {setup.bytes_per_token} B/token); prefill assumed {setup.prefill_tokens_per_s:.0f} tokens/s",
        flush=True,
    )
    rows, pairs_out = [], []
    mode = "sweep" if a.nodes == 1 else f"{a.nodes} nodes, {a.routing} routing"
    mode += ", cluster" if a.cluster else ""
    distinct = len({h for r in reqs for h in r.hash_ids})

    def memory(pages: int | None) -> int | None:
        return cluster_memory(pages, setup.page_bytes, distinct) if a.cluster else None

    for cap in caps:  # every cluster's size checked before the first replay
        pages = tr.blocks_of(cap)
        memory(None if pages is None else pages * a.nodes)

    for cap in caps:
        pages = tr.blocks_of(cap)
        if a.nodes == 1:
            row = run(
                reqs,
                setup,
                nodes=1,
                store_pages=pages,
                shared=False,
                routing=a.routing,
                seed=a.seed,
                label=f"{tr.label(cap)}",
                cluster_memory=memory(pages),
            )
            row["one_lru_pct"] = one_lru_pct(pairs, pages)
            row["capacity"] = tr.label(cap)
            rows.append(row)
            continue
        sep = run(
            reqs,
            setup,
            nodes=a.nodes,
            store_pages=pages,
            shared=False,
            routing=a.routing,
            seed=a.seed,
            label=f"separate-{tr.label(cap)}",
        )
        shr = run(
            reqs,
            setup,
            nodes=a.nodes,
            store_pages=None if pages is None else pages * a.nodes,
            shared=True,
            routing=a.routing,
            seed=a.seed,
            label=f"shared-{tr.label(cap)}",
            cluster_memory=memory(None if pages is None else pages * a.nodes),
        )
        sep["capacity"] = shr["capacity"] = tr.label(cap)  # the rows name the per-node capacity
        rows += [sep, shr]
        pairs_out.append((sep, shr))
    # the paper's figures stand beside a whole known trace only
    known = trace.known if trace.known and len(reqs) == tr.KNOWN[trace.known].requests else None
    if a.nodes == 1:
        table = sweep_table(rows, best, known)
    else:
        shared = (
            "the Mooncake cluster tier (one LocalCluster), memory for N × the per-node capacity"
            if a.cluster
            else "one PageStore of N × the per-node capacity"
        )
        table = nodes_table(pairs_out, known) + f"\nshared tier: {shared}; separate: a PageStore per node\n"
    if a.cluster:
        table += _cluster_note(rows)
    t = rows[-1]["ttft"]
    tier = rows[-1]["store_tier"]
    src = "assumed" if tier in setup.assumed_gbps else t["store_source"]
    table += (
        f"\nTTFT: the planner's prediction per request, mean; prefill {setup.prefill_tokens_per_s:.0f} tokens/s "
        f"(assumed), {tier} read {t['store_read_GBps'] or 0:.2f} GB/s ({src}); a block of the model geometry is "
        f"{setup.bytes_per_token * tr.BLOCK_TOKENS / 2**20:.0f} MiB\n"
    )
    bad = disagreements(rows, a.tolerance)
    table += (
        "\n"
        + (
            "\n".join(f"DISAGREE: {b}" for b in bad)
            if bad
            else f"kvtier agrees with the LRU model within {a.tolerance} point(s) on every row "
            f"(requests whose hits differ: {', '.join(str(r['requests_differing']) for r in rows)})"
        )
        + "\n"
    )
    print(f"\n## {name}: {mode}\n\n{table}", flush=True)
    return {
        "trace": name,
        "sha256": trace.sha256,
        "requests": len(reqs),
        "mode": mode,
        "best_pct": best,
        "host_tokens": setup.host_pages * tr.BLOCK_TOKENS,
        "page_bytes": setup.page_bytes,
        "bytes_per_token": setup.bytes_per_token,
        "prefill_tokens_per_s": setup.prefill_tokens_per_s,
        "assumed_read_gbps": setup.assumed_gbps,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "rows": rows,
        "table": table,
        "disagreements": bad,
    }


def _cluster_note(rows: list[dict[str, Any]]) -> str:
    """The cluster runs' memory, pages held (kvtier: the master's object count / 3 at the end; the model),
    pages evicted, and pages a lookup found that the read did not deliver (kvtier: the tier's misses)."""
    parts = [
        f"{r['label']}: {r['cluster_memory_bytes'] / 2**20:.0f} MiB, held {r['kvtier']['store_pages_held']} / "
        f"{r['model']['store_pages_held']} pages, evicted {r['kvtier']['store_evictions']} / "
        f"{r['model']['store_evictions']}, found but not read {r['kvtier']['store_read_misses']}"
        for r in rows
        if r.get("cluster_memory_bytes")
    ]
    return (
        "\ncluster (memory; pages held at the end and evicted, kvtier / model; pages found but not read, kvtier): " + "; ".join(parts) + "\n"
        if parts
        else ""
    )


def _save(out: str, result: dict[str, Any]) -> None:
    """Merges this run into ``out``/cpu-replay.json (one entry per trace and mode) and rewrites the tables."""
    path = os.path.join(out, "cpu-replay.json")
    runs: dict[str, Any] = {}
    if os.path.exists(path):
        with open(path) as f:
            runs = json.load(f)
    runs[f"{result['trace']} {result['mode']}"] = result
    md = "".join(f"## {k}\n\n{v['table']}\n" for k, v in runs.items() if isinstance(v, dict))
    write_results(out, {"cpu-replay.json": json.dumps(runs, indent=1), "cpu-replay.md": md})
    print(f"results in {path} and cpu-replay.md")


if __name__ == "__main__":
    main()
