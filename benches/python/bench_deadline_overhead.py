"""What deadlines cost when nothing stalls: one request's store lookup (``match``) and its prefetch of pages
from the disk (``prefetch(...).result()``) through ``TierController``, timed over many requests; the store call
made directly (no controller, no deadline) is the ceiling, measured in the same run.

    python benches/python/bench_deadline_overhead.py [--requests 2000] [--pages 8] [--python-path DIR]

``--python-path``: import kvtier's Python from another checkout (its ``python`` directory) to compare two
versions of the controller on the same native library (``benches/deadline_ab.sh`` does that, alternating)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--pages", type=int, default=8)
    ap.add_argument("--python-path", default=None)
    a = ap.parse_args()
    if a.python_path:
        sys.path.insert(0, a.python_path)
    import torch

    from kvtier import DeviceKVPool, PageStore, TierController, host_pool_for, page_hashes

    ps = 16
    dp = DeviceKVPool(4 * a.pages * ps, ps, 4, 4, 64, 64, torch.bfloat16, "cpu")
    per_page = ps * 4 * 128 * 4 * 2
    hp = host_pool_for(dp, host_size_gb=(2 * a.pages + 1) * per_page / 1e9, layout="page_first_direct")
    st = PageStore(tempfile.mkdtemp(prefix="kvtier-deadline-bench-"), capacity_bytes=1 << 28)
    st.register_mem_pool_host(hp)
    ctl = TierController(dp, hp, st, probe=False)
    keys = page_hashes(list(range(a.pages * ps)), ps)
    rows = torch.arange(a.pages * ps, dtype=torch.int64)
    ctl.backup(rows, keys)
    ctl.wait_idle()
    direct_get, direct_exists, match, fetch = [], [], [], []
    idx = torch.arange(a.pages * ps, 2 * a.pages * ps, dtype=torch.int64)  # free host pages for the direct reads
    for _ in range(a.requests):
        ctl.evict_unreferenced()
        t0 = time.perf_counter()
        got = ctl.match(keys)
        t1 = time.perf_counter()
        n = ctl.prefetch(keys).result()
        t2 = time.perf_counter()
        assert got == (0, a.pages) and n == a.pages, (got, n)
        match.append(t1 - t0)
        fetch.append(t2 - t1)
        ctl.evict_unreferenced()
        got_idx = hp.alloc(a.pages * ps)
        t0 = time.perf_counter()
        m = st.batch_exists(keys)
        t1 = time.perf_counter()
        ok = st.batch_get_v1(keys, got_idx)
        t2 = time.perf_counter()
        hp.free(got_idx)
        assert m == a.pages and all(ok)
        direct_exists.append(t1 - t0)
        direct_get.append(t2 - t1)
    del idx
    ctl.close()
    st.close()
    med = {k: statistics.median(v) * 1e6 for k, v in (("direct_exists_us", direct_exists), ("match_us", match),
                                                       ("direct_get_us", direct_get), ("prefetch_us", fetch))}
    med["match_over_direct"] = med["match_us"] / med["direct_exists_us"]
    med["prefetch_over_direct"] = med["prefetch_us"] / med["direct_get_us"]
    print(json.dumps({"requests": a.requests, "pages": a.pages, "python": a.python_path or "this checkout", **med}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
