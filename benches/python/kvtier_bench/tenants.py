"""What tenants and encryption at rest cost, each against the same thing without them, in one run.

    python -m kvtier_bench tenants [--dir DIR [--dir DIR2 ...]] [--reps 3] [--cluster-reps 5] [--no-cluster] [--out DIR]

- **Seal**: AES-256-GCM sealing (copy + encrypt) and opening (decrypt in place) of 4 MiB objects on one core,
  GB/s, beside crc32c of the same bytes.
- **Disk tier**: ``python -m kvtier_bench store``'s cases (durable ``batch_set_v1``, O_DIRECT ``batch_get_v1``) for a
  store in clear and a sealed store, fresh stores alternating which goes first, with the disk's own O_DIRECT
  ceiling measured in the same run; sealed as a share of clear and of the ceiling. Each ``--dir`` is a disk
  (a fast one, and one as slow as the servers' can be measured in one run).
- **Cluster tier** (a local Mooncake cluster on loopback): raw ``batch_put_from`` / ``batch_get_into``, the
  tier in clear and the sealed tier on the same pages.
- **Lookups**: the median cost of ``batch_exists`` for a page the tenant has (a hit), the same page asked by
  another tenant, and a page nobody has (a miss): across-tenant must cost what a miss costs.

Writes ``cpu-tenants.json`` / ``.md`` into --out only at the end.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from kvtier import DeviceKVPool, PageStore, _native, host_pool_for, page_hashes

from kvtier._cleanup import remove_tree
from kvtier.buffer import HostBuffer
from kvtier.tenants import Keyring
from kvtier.tiers.objects.records import SEAL
from . import store as store_bench
from .options import parser
from ._common import fs_type, out_dir, write_results


def seal_rate(reps: int = 5, mib: int = 4, count: int = 16) -> dict[str, float]:
    """One core sealing, opening and checksumming ``count`` objects of ``mib`` MiB, GB/s (medians)."""
    with tempfile.TemporaryDirectory() as d:
        kr = Keyring.init(os.path.join(d, "k"))
        n = mib << 20
        buf = HostBuffer(2 * n * count, pin=False)
        buf.as_tensor(torch.uint8, (buf.nbytes,)).random_(0, 256)
        ranges = _native.HostRanges()
        ranges.register_region(buf.region)
        names = [f"t0123456789abcdef0123456789abcdef.obj{i}" for i in range(count)]
        src = [buf.ptr + i * n for i in range(count)]
        dst = [buf.ptr + (count + i) * n for i in range(count)]
        tenants = [kr.stored_tag(tag="0123456789abcdef0123456789abcdef")] * count
        out: dict[str, list[float]] = {"seal": [], "open": [], "crc32c": []}
        for _ in range(reps):
            t0 = time.perf_counter()
            seals = b""
            for i in range(count):  # one object per call: one core
                s, ok = kr.native.seal_into(ranges, [(names[i], src[i], n, tenants[0])], dst[i:i + 1])
                assert all(ok)
                seals += bytes(s)
            out["seal"].append(n * count / (time.perf_counter() - t0) / 1e9)
            t0 = time.perf_counter()
            for i in range(count):
                assert all(kr.native.open_in_place(ranges, [(names[i], dst[i], n, tenants[0])],
                                                    seals[i * SEAL:(i + 1) * SEAL]))
            out["open"].append(n * count / (time.perf_counter() - t0) / 1e9)
            t0 = time.perf_counter()
            for i in range(count):
                ranges.crc32c(names[i:i + 1], src[i:i + 1], [n])
            out["crc32c"].append(n * count / (time.perf_counter() - t0) / 1e9)
        buf.close()
    return {f"{k}_GBps_one_core": round(statistics.median(v), 3) for k, v in out.items()}


def disk(root: str, reps: int, cases: list[str], pages: int | None) -> list[dict[str, Any]]:
    kr = Keyring.init(os.path.join(root, "keyring"))
    fs = fs_type(root)
    rows = []
    for name in cases:
        c = dict(store_bench.CASES[name])
        if pages:
            c["pages"], c["batch"] = pages, min(c["batch"], pages)
        hp, n, ksize, vsize, total = store_bench.case_pool(c)
        keys = [f"{i:064x}" for i in range(n)]
        idx = torch.arange(n * c["page"])
        got: dict[str, list[float]] = {k: [] for k in ("ceil_w", "ceil_r", "clear_w", "clear_r", "sealed_w", "sealed_r")}
        exact = True
        for rep in range(reps):
            wk, rk, _ = _native.disk_roofline(root, ksize, n, store_bench.THREADS)
            wv, rv, _ = _native.disk_roofline(root, vsize, n, store_bench.THREADS)
            got["ceil_w"].append(total / (n * ksize / wk + n * vsize / wv))
            got["ceil_r"].append(total / (n * ksize / rk + n * vsize / rv))
            order = [("clear", None), ("sealed", kr)]
            for label, ring in (order if rep % 2 == 0 else order[::-1]):
                d = os.path.join(root, f"{name}-{label}-{rep}")
                try:
                    w, r, ok, _ = store_bench.one_round(d, hp, keys, idx, n, c, total, keyring=ring)
                finally:
                    remove_tree(d)
                got[f"{label}_w"].append(w)
                got[f"{label}_r"].append(r)
                exact &= ok
        hp.close()
        med = {k: statistics.median(v) for k, v in got.items()}
        row = {"case": name, "disk": fs, "dir": root, "pages": n, "k_object_bytes": ksize, "v_object_bytes": vsize,
               **{f"{k}_GBps": round(v, 3) for k, v in med.items()},
               "sealed_vs_clear_write_pct": round(100 * med["sealed_w"] / med["clear_w"], 1),
               "sealed_vs_clear_read_pct": round(100 * med["sealed_r"] / med["clear_r"], 1),
               "sealed_write_pct_of_ceiling": round(100 * med["sealed_w"] / med["ceil_w"], 1),
               "sealed_read_pct_of_ceiling": round(100 * med["sealed_r"] / med["ceil_r"], 1),
               "all": {k: [round(x, 3) for x in v] for k, v in got.items()}, "bit_exact": exact}
        print(json.dumps({k: v for k, v in row.items() if k != "all"}), flush=True)
        rows.append(row)
    return rows


def cluster(reps: int, cases: list[str], keyring_dir: str) -> list[dict[str, Any]]:
    from kvtier.tiers.local_cluster import LocalCluster
    from . import mooncake as mc

    kr = Keyring.init(keyring_dir)
    rows = []
    with LocalCluster(storage_nodes=1, segment_bytes=3 << 30, lease_ttl_ms=1000) as c:
        for name in cases:
            clear = mc.run_case(name, c, reps)
            sealed = mc.run_case(name, c, reps, keyring=kr)
            row = {"case": name, "batch_bytes": clear["batch_bytes"],
                   "raw_put_GBps": clear["raw_put_GBps"], "raw_get_GBps": clear["raw_get_GBps"],
                   "clear_put_GBps": clear["kvtier_put_GBps"], "clear_get_GBps": clear["kvtier_get_GBps"],
                   "sealed_put_GBps": sealed["kvtier_put_GBps"], "sealed_get_GBps": sealed["kvtier_get_GBps"],
                   "sealed_raw_put_GBps": sealed["raw_put_GBps"], "sealed_raw_get_GBps": sealed["raw_get_GBps"],
                   "clear_put_pct_of_raw": clear["put_pct"], "clear_get_pct_of_raw": clear["get_pct"],
                   "sealed_put_pct_of_raw": sealed["put_pct"], "sealed_get_pct_of_raw": sealed["get_pct"],
                   # each mode against raw Mooncake measured in turn with it (the loopback drifts between cases)
                   "sealed_vs_clear_put_pct": round(100 * sealed["put_pct"] / clear["put_pct"], 1),
                   "sealed_vs_clear_get_pct": round(100 * sealed["get_pct"] / clear["get_pct"], 1),
                   "bit_exact": clear["bit_exact"] and sealed["bit_exact"]}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def lookups(root: str, rounds: int = 300) -> dict[str, Any]:
    dp = DeviceKVPool(64 * 16, 16, 2, 2, 64, 64, torch.bfloat16, "cpu")
    hp = host_pool_for(dp, layout="page_first_direct", host_to_device_ratio=1.0, pin_memory=False)
    tokens = list(range(64 * 16))
    alice = page_hashes(tokens, 16, salt="alice")
    bob = page_hashes(tokens, 16, salt="bob")
    nobody = page_hashes([t + 10**6 for t in tokens], 16, salt="bob")
    out: dict[str, list[float]] = {"hit": [], "other_tenant": [], "miss": []}
    with PageStore(os.path.join(root, "lookups"), capacity_bytes=1 << 30, probe_bytes=0) as st:
        st.register_mem_pool_host(hp)
        assert all(st.batch_set_v1(alice, torch.arange(64 * 16)))
        sets = {"hit": alice, "other_tenant": bob, "miss": nobody}
        for r in range(rounds):
            for label in (list(sets) if r % 2 else list(sets)[::-1]):
                t0 = time.perf_counter_ns()
                for k in sets[label]:
                    st.batch_exists([k])
                out[label].append((time.perf_counter_ns() - t0) / len(sets[label]) / 1e3)
        assert st.batch_exists(bob) == 0 and st.batch_exists(alice) == 64
    hp.close()
    med = {k: round(statistics.median(v), 2) for k, v in out.items()}
    row = {f"{k}_us_per_lookup": v for k, v in med.items()}
    row["other_tenant_vs_miss_pct"] = round(100 * med["other_tenant"] / med["miss"], 1)
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    ap = parser("tenants")
    a = ap.parse_args(argv)
    cases = a.cases.split(",")
    if any(x not in store_bench.CASES for x in cases):
        ap.error(f"--cases: choose from {sorted(store_bench.CASES)}")
    if a.reps < 1 or a.cluster_reps < 1 or (a.pages is not None and a.pages < 1):
        ap.error("--reps, --cluster-reps and --pages must be at least 1")
    out = out_dir(a.out)
    roots, made = [], []
    for d in a.dir or [None]:
        if d is None:
            d = tempfile.mkdtemp(prefix="kvtier-bench-tenants-", dir=os.getcwd())
            made.append(d)
        elif not os.path.exists(d):
            made.append(d)  # a --dir this run makes is removed after it
        roots.append(d)
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "dirs": roots, "disk": []}
    try:
        for d in roots:
            os.makedirs(d, exist_ok=True)
            print(f"disk: {fs_type(d)} ({d})", flush=True)
        res["seal"] = seal_rate()
        print(json.dumps(res["seal"]), flush=True)
        res["lookups"] = lookups(roots[0])
        for d in roots:
            res["disk"] += disk(d, a.reps, cases, a.pages)
        res["cluster"] = [] if a.no_cluster else cluster(a.cluster_reps, a.cluster_cases.split(","),
                                                         os.path.join(roots[0], "cluster-keyring"))
    finally:
        for d in roots:
            if d in made:
                remove_tree(d)
            else:
                for sub in ("keyring", "cluster-keyring", "lookups"):
                    remove_tree(os.path.join(d, sub))
    s, lk = res["seal"], res["lookups"]
    lines = [f"# kvtier tenants and encryption at rest — {res['date']}", "",
             f"One core: seal {s['seal_GBps_one_core']} GB/s, open {s['open_GBps_one_core']} GB/s, "
             f"crc32c {s['crc32c_GBps_one_core']} GB/s (4 MiB objects).", "",
             f"Lookups (µs each, median): hit {lk['hit_us_per_lookup']}, another tenant's page "
             f"{lk['other_tenant_us_per_lookup']}, a miss {lk['miss_us_per_lookup']} "
             f"(another tenant's = {lk['other_tenant_vs_miss_pct']}% of a miss).", "",
             "| disk | case | ceiling write | clear write | sealed write | sealed/clear | ceiling read | clear read | "
             "sealed read | sealed/clear | exact |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["disk"]:
        lines.append(f"| {r['disk']} | {r['case']} ({r['pages']} pages) | {r['ceil_w_GBps']} | {r['clear_w_GBps']} | {r['sealed_w_GBps']} | "
                     f"{r['sealed_vs_clear_write_pct']}% | {r['ceil_r_GBps']} | {r['clear_r_GBps']} | "
                     f"{r['sealed_r_GBps']} | {r['sealed_vs_clear_read_pct']}% | {r['bit_exact']} |")
    if res["cluster"]:
        lines += ["", "Cluster: each mode as a share of raw Mooncake measured in turn with it (put / get).", "",
                  "| cluster case | clear put | % of raw | sealed put | % of raw | clear get | % of raw | sealed get | "
                  "% of raw | sealed/clear (put, get) | exact |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in res["cluster"]:
            lines.append(f"| {r['case']} | {r['clear_put_GBps']} | {r['clear_put_pct_of_raw']}% | {r['sealed_put_GBps']} | "
                         f"{r['sealed_put_pct_of_raw']}% | {r['clear_get_GBps']} | {r['clear_get_pct_of_raw']}% | "
                         f"{r['sealed_get_GBps']} | {r['sealed_get_pct_of_raw']}% | {r['sealed_vs_clear_put_pct']}%, "
                         f"{r['sealed_vs_clear_get_pct']}% | {r['bit_exact']} |")
    md = "\n".join(lines) + "\n(GB/s; medians)\n"
    print(md)
    if out is not None:
        write_results(out, {"cpu-tenants.json": json.dumps(res, indent=1), "cpu-tenants.md": md})
        print(f"results in {out}/cpu-tenants.json and .md")


if __name__ == "__main__":
    main()
