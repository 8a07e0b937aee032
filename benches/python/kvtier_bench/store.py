"""PageStore throughput against the disk's own O_DIRECT ceiling, measured in the same run on the same disk.

    python -m kvtier_bench store [--dir DIR] [--reps 3] [--out DIR] [--plot store.png]

Cases (objects per page: one K, one V):
  - mimo:  MiMo-V2-like pages, 48 layers x 64 tokens x 4 heads x (K 192 | V 128) bf16 = K 4.5 MiB + V 3 MiB,
           in one batch of 96 pages (HiCache batches up to 128 pages per storage call);
  - small: 64 KiB objects (1 layer x 64 tokens x 4 heads x 128, K and V), batches of 256 pages.
For each: the ceiling (O_DIRECT pwrite of the same object sizes with the same queue depth into a
preallocated file, then fdatasync; O_DIRECT pread) and kvtier's ``batch_set_v1`` in steady state (slots
already allocated by an earlier fill that was deleted; durable: returns after fdatasync of data and journal) and
``batch_get_v1`` (O_DIRECT: the page cache is not involved), medians over --reps fresh stores, with the
ratio to the ceiling. Prints the file system and the results; writes store.json / store.md only into --out,
and a bar chart only to --plot (both checked before the bench starts).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

import torch

import kvtier
from kvtier import DeviceKVPool, PageStore, _native, host_pool_for

from kvtier._cleanup import remove_tree
from .options import parser
from ._common import bar_plot, check_plot_path, fs_type, out_dir, write_results

CASES = {
    "mimo": dict(layers=48, page=64, heads=4, dk=192, dv=128, pages=96, batch=96),
    "small": dict(layers=1, page=64, heads=4, dk=128, dv=128, pages=4096, batch=256),
}
THREADS = 16


def one_round(d, hp, keys, idx, n, c, total, keyring=None):
    """One fresh store: a warm fill deleted, then timed durable writes and verified reads of the same pages
    (sealed with ``keyring`` when given)."""
    st = PageStore(d, capacity_bytes=4 * total, io_threads=THREADS, keyring=keyring)
    try:
        st.register_mem_pool_host(hp)
        ref = (hp.k_buffer.clone(), hp.v_buffer.clone())
        # Steady state: a store that has been running has its slots allocated already (evictions and
        # deletions free them for reuse). Fill once with other keys, delete them, then time.
        warm = [f"warm-{i}" for i in range(n)]
        for s in range(0, n, c["batch"]):
            st.batch_set_v1(warm[s : s + c["batch"]], idx[s * c["page"] : (s + c["batch"]) * c["page"]])
        st.clear()
        t0 = time.perf_counter()
        for s in range(0, n, c["batch"]):
            ok = st.batch_set_v1(keys[s : s + c["batch"]], idx[s * c["page"] : (s + c["batch"]) * c["page"]])
            if not all(ok):
                raise kvtier.KvtierError(f"the store at {d} refused {ok.count(False)} pages (a full disk? "
                                         f"`python -m kvtier_bench store` needs about {4 * total / 1e9:.1f} GB free); "
                                         "pass --dir on a disk with room, or fewer --pages")
        w = total / (time.perf_counter() - t0) / 1e9
        hp.k_buffer.zero_()
        hp.v_buffer.zero_()
        t0 = time.perf_counter()
        for s in range(0, n, c["batch"]):
            ok = st.batch_get_v1(keys[s : s + c["batch"]], idx[s * c["page"] : (s + c["batch"]) * c["page"]])
            if not all(ok):
                raise kvtier.KvtierError(f"the store at {d} could not read back {ok.count(False)} pages")
        r = total / (time.perf_counter() - t0) / 1e9
        # the pool has one spare page beyond the n stored (HiCache sizing): compare the stored ones
        exact = torch.equal(hp.k_buffer[:n].view(torch.uint8), ref[0][:n].view(torch.uint8)) and torch.equal(
            hp.v_buffer[:n].view(torch.uint8), ref[1][:n].view(torch.uint8)
        )
        return w, r, bool(exact), st.get_stats()["o_direct"]
    finally:
        st.close()


def case_pool(c):
    """A random host pool of case ``c``: (pool, pages, K object bytes, V object bytes, bytes in all)."""
    dp = DeviceKVPool(c["pages"] * c["page"], c["page"], c["layers"], c["heads"], c["dk"], c["dv"], torch.bfloat16, "cpu")
    hp = host_pool_for(dp, layout="page_first_direct", host_to_device_ratio=1.0, pin_memory=False)
    for t in (hp.k_buffer, hp.v_buffer):
        t.view(torch.uint8).random_(0, 256)
    n = c["pages"]
    ksize = c["layers"] * c["page"] * c["heads"] * c["dk"] * 2
    vsize = c["layers"] * c["page"] * c["heads"] * c["dv"] * 2
    return hp, n, ksize, vsize, n * (ksize + vsize)


def run_case(name, c, root, reps):
    hp, n, ksize, vsize, total = case_pool(c)
    # ceiling: the same number of objects of each size, same queue depth
    cw, cr = [], []
    for _ in range(reps):
        wk, rk, direct = _native.disk_roofline(root, ksize, n, THREADS)
        wv, rv, _ = _native.disk_roofline(root, vsize, n, THREADS)
        # combine as time-weighted throughput over the same bytes
        cw.append(total / (n * ksize / wk + n * vsize / wv))
        cr.append(total / (n * ksize / rk + n * vsize / rv))
    keys = [f"{i:064x}" for i in range(n)]
    idx = torch.arange(n * c["page"])
    ws, rs = [], []
    exact = True
    for rep in range(reps):
        d = os.path.join(root, f"store-{name}-{rep}")
        try:
            w, r, ok_bits, o_direct = one_round(d, hp, keys, idx, n, c, total)
        finally:  # a failed or interrupted round leaves no store behind
            remove_tree(d)
        ws.append(w)
        rs.append(r)
        exact &= ok_bits
    hp.close()
    row = {
        "case": name, "pages": n, "k_object_bytes": ksize, "v_object_bytes": vsize, "queue_depth": THREADS,
        "ceiling_write_GBps": round(statistics.median(cw), 3), "ceiling_read_GBps": round(statistics.median(cr), 3),
        "kvtier_write_GBps": round(statistics.median(ws), 3), "kvtier_read_GBps": round(statistics.median(rs), 3),
        "write_pct": round(100 * statistics.median(ws) / statistics.median(cw), 1),
        "read_pct": round(100 * statistics.median(rs) / statistics.median(cr), 1),
        "all_write": [round(x, 3) for x in ws], "all_read": [round(x, 3) for x in rs],
        "o_direct": o_direct, "ceiling_o_direct": direct, "bit_exact": exact,
    }
    print(json.dumps(row), flush=True)
    return row


def main(argv=None):
    ap = parser("store")
    a = ap.parse_args(argv)
    unknown = [c for c in a.cases.split(",") if c not in CASES]
    if unknown:
        ap.error(f"--cases: unknown {unknown}; choose from {sorted(CASES)}")
    if a.reps < 1 or (a.pages is not None and a.pages < 1):
        ap.error("--reps and --pages must be at least 1")
    check_plot_path(a.plot)
    out = out_dir(a.out)
    created = a.dir is not None and not os.path.exists(a.dir)  # a --dir this run makes is removed after it
    try:
        root = a.dir or tempfile.mkdtemp(prefix="kvtier-bench-store-", dir=os.getcwd())
        os.makedirs(root, exist_ok=True)
    except OSError as exc:
        raise kvtier.KvtierError(f"cannot create the bench directory ({exc}); pass --dir on the disk to measure") from None
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "dir": root, "fs": fs_type(root), "rows": []}
    print(f"disk: {res['fs']} ({root})", flush=True)
    try:
        for name in a.cases.split(","):
            case = dict(CASES[name])
            if a.pages:
                case["pages"] = a.pages
                case["batch"] = min(case["batch"], a.pages)
            res["rows"].append(run_case(name, case, root, a.reps))
    finally:
        if a.dir is None or created:
            remove_tree(root)
    lines = [f"# kvtier page store — {res['date']} — {res['fs']}", "",
             "| case | objects | ceiling write | kvtier write (durable) | % | ceiling read | kvtier read (O_DIRECT) | % | exact |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(
            f"| {r['case']} | {r['pages']} x (K {r['k_object_bytes'] >> 10} KiB + V {r['v_object_bytes'] >> 10} KiB) | "
            f"{r['ceiling_write_GBps']} GB/s | {r['kvtier_write_GBps']} GB/s | {r['write_pct']}% | {r['ceiling_read_GBps']} GB/s | "
            f"{r['kvtier_read_GBps']} GB/s | {r['read_pct']}% | {r['bit_exact']} |"
        )
    md = "\n".join(lines) + "\n"
    print(md)
    if out is not None:
        write_results(out, {"store.json": json.dumps(res, indent=1), "store.md": md})
        print(f"results in {out}/store.json and store.md")
    if a.plot:
        groups = [f"{r['case']} {w}" for r in res["rows"] for w in ("write", "read")]
        ceiling = [r[f"ceiling_{w}_GBps"] for r in res["rows"] for w in ("write", "read")]
        ours = [r[f"kvtier_{w}_GBps"] for r in res["rows"] for w in ("write", "read")]
        bar_plot(a.plot, f"kvtier page store vs the disk's O_DIRECT ceiling ({res['fs']})", groups,
                 {"ceiling (same sizes, same queue depth)": ceiling, "kvtier (durable write / verified read)": ours}, "GB/s")
        print(f"plot in {a.plot}")


if __name__ == "__main__":
    main()
