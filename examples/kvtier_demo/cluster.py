"""``python -m kvtier_demo --cluster``: two inference nodes sharing one KV cache through a Mooncake cluster.

A local cluster (a Mooncake master and one storage process on 127.0.0.1) and two node processes, each with its
own host pool and its own local disk store, serving the same multi-turn workload (kvtier_demo.workload) through
``TierController`` over the tier chain disk → cluster. Node A runs first: it computes the prefixes and writes
every page through to its disk and the cluster. Node B runs next with an empty host pool and an empty disk:
every prefix A computed is a **cluster hit** for B. Both print TTFT by source against recomputing the same
prefix, and both check every restored prefix and every output bit for bit against a fresh recomputation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from kvtier._cleanup import remove_tree


def run_cluster(*, conversations: int = 3, turns: int = 3, seed: int = 0, store_dir: str | None = None) -> int:
    from kvtier.tiers.local_cluster import LocalCluster

    root = store_dir or tempfile.mkdtemp(prefix="kvtier-demo-cluster-", dir=os.getcwd())
    failures, finished = 0, False
    try:
        # the node processes import this package: its directory goes on their path (a test may have put it on
        # sys.path only)
        examples = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.pathsep.join(p for p in (examples, os.environ.get("PYTHONPATH")) if p)
        with LocalCluster(storage_nodes=1, segment_bytes=256 << 20, log_dir=os.path.join(root, "logs")) as c:
            print(f"cluster: Mooncake master at {c.master_address} and one storage process (logs in {c.log_dir})")
            summary = {}
            for node, what in (("A", "computes the prefixes, writes them through to its disk and the cluster"),
                               ("B", "another node: empty host pool, empty disk; the cluster has A's pages")):
                print(f"\n== node {node}: {what}", flush=True)
                env = {**os.environ, "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR"), "PYTHONPATH": path}
                cmd = [sys.executable, "-m", "kvtier_demo.cluster", "--node", node, "--master", c.master_address,
                       "--conversations", str(conversations), "--turns", str(turns), "--seed", str(seed),
                       "--store-dir", os.path.join(root, f"node-{node}")]
                log = os.path.join(str(c.log_dir), f"node-{node}.log")
                with open(log, "w") as err:
                    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
                lines = r.stdout.splitlines()
                print("\n".join(x for x in lines if not x.startswith("{")), flush=True)
                result = next((json.loads(x) for x in lines if x.startswith("{")), None)
                if r.returncode != 0 or result is None:
                    with open(log) as f:
                        tail = f.read()[-3000:]
                    print(f"node {node} FAILED (exit {r.returncode}); its log ({log}) ends with:\n{tail}")
                    failures += 1
                    continue
                failures += result["failures"]
                summary[node] = result
            if "B" in summary:
                b = summary["B"]
                print(f"\nnode B: {b['cluster_pages']} of {b['pages']} pages came from the cluster, "
                      f"{b['recomputed_pages']} were recomputed; cluster tier read "
                      f"{b['cluster_bytes'] / 1e6:.1f} MB, integrity misses {b['cluster_corrupt'] + b['cluster_stale']}")
        finished = True
    finally:
        logs = os.path.join(root, "logs")
        if store_dir is None and (finished and not failures or not os.path.isdir(logs) or not os.listdir(logs)):
            remove_tree(root)
        elif store_dir is None:  # the logs a failure pointed to stay where it said they are
            print(f"demo --cluster: kept {root} for its logs ({logs}); remove it when done", file=sys.stderr)
    print("demo --cluster:", "all checks passed" if not failures else f"{failures} check(s) FAILED")
    return 1 if failures else 0


def _node(a: argparse.Namespace) -> int:
    import torch

    from .workload import run_workload

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = run_workload(device=device, n_conv=a.conversations, turns=a.turns, seed=a.seed, store_dir=a.store_dir,
                       cluster=a.master)
    res = out["results"]
    tiers = out["tiers"]
    own = tiers["mooncake"]["store"]
    summary = {
        "node": a.node, "failures": len(out["failures"]),
        "pages": sum(r["tokens"] // out["page_size"] for r in res),
        "cluster_pages": sum(r["disk_hit"] for r in res if r["source"] == "cluster hit"),
        "recomputed_pages": sum(r["tokens"] // out["page_size"] - r["cached_pages"] for r in res),
        "cluster_bytes": tiers["mooncake"]["bytes_in"], "cluster_corrupt": own["corrupt"], "cluster_stale": own["stale"],
        "ttft_ms": {src: 1e3 * sum(r["ttft_s"] for r in res if r["source"] == src) /
                    max(1, sum(1 for r in res if r["source"] == src)) for src in {r["source"] for r in res}},
    }
    print(json.dumps(summary), flush=True)
    return 1 if out["failures"] else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvtier_demo.cluster")
    ap.add_argument("--node", required=True)
    ap.add_argument("--master", required=True)
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--store-dir", required=True)
    return _node(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
