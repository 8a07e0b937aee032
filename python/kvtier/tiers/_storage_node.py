"""A Mooncake storage process: mounts ``--segment`` bytes of memory into the cluster and serves them until its
standard input closes (its parent ended) or it is signalled. Started by :class:`kvtier.tiers.local_cluster.
LocalCluster`; prints ``ready`` once its segment is mounted."""

from __future__ import annotations

import argparse
import signal
import sys


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m kvtier.tiers._storage_node")
    ap.add_argument("--master", required=True)
    ap.add_argument("--hostname", default="127.0.0.1")
    ap.add_argument("--segment", type=int, required=True)
    ap.add_argument("--protocol", default="tcp")
    ap.add_argument("--metadata", default="P2PHANDSHAKE")
    a = ap.parse_args()
    from ._mooncake_env import store_class

    store = store_class()()
    rc = store.setup(a.hostname, a.metadata, a.segment, 16 << 20, a.protocol, "", a.master)
    if rc != 0:
        print(f"setup failed: {rc}", flush=True)
        return 1
    print("ready", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        sys.stdin.read()  # until the parent closes our stdin (or dies)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
