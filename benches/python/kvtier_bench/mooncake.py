"""The cluster tier against Mooncake's own zero-copy calls on the same objects, in the same run.

    python -m kvtier_bench mooncake [--reps 7] [--storage-nodes 1] [--out DIR]

A local cluster (kvtier.tiers.local_cluster: a master and storage processes on 127.0.0.1) and one client
process. Cases: single objects of 64 KiB, 256 KiB, 1 MiB and 4 MiB (an MLA-shaped pool, one object per page), and the
K/V page pairs of a MiMo-like page (48 layers x 64 tokens x 4 heads x K 192 | V 128, bf16: 4.5 + 3 MiB) and
one DeepSeek-like latent page (61 layers x 64 tokens x 576, bf16: 4.3 MiB). For each, per repetition with fresh
keys: the ceiling — Mooncake's ``batch_put_from`` / ``batch_get_into`` of exactly the pool's page objects —
then ``MooncakeTier.batch_set_v1`` / ``batch_get_v1`` of the same pages (which add the existence check, the
crc32c of every object, the integrity records and their check). Medians, and kvtier as a share of the raw
figure. Gets are checked bit-exact. Writes ``cpu-mooncake.json`` / ``.md`` into --out only at the end.

What integrity costs, split in the same run: raw Mooncake moving the page objects plus one record-sized object
per page (what the integrity records cost in objects and round trips, without computing anything), and one
core's crc32c of the batch's bytes (what computing the checksums costs; the tier computes them for every put
and get), each as a share of the raw figure.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any, NamedTuple

import torch

from kvtier import DeviceKVPool, MLADeviceKVPool, host_pool_for

from kvtier.tiers.local_cluster import LocalCluster
from kvtier.tiers.objects.records import record_size
from kvtier.tiers.mooncake import MooncakeTier
from .options import parser
from ._common import out_dir, write_results

# name: (kind, geometry, pages per batch)
CASES = {
    "64KiB": ("mla", dict(layers=1, page=64, lora=448, rope=64), 256),
    "256KiB": ("mla", dict(layers=4, page=64, lora=448, rope=64), 128),
    "1MiB": ("mla", dict(layers=16, page=64, lora=448, rope=64), 64),
    "4MiB": ("mla", dict(layers=64, page=64, lora=448, rope=64), 32),
    "mimo-kv": ("mha", dict(layers=48, page=64, heads=4, dk=192, dv=128), 32),
    "deepseek-latent": ("mla", dict(layers=61, page=64, lora=512, rope=64), 32),
}


def _pool(kind: str, g: dict, pages: int) -> Any:
    if kind == "mla":
        dp = MLADeviceKVPool(g["page"] * pages, g["page"], g["layers"], g["lora"], g["rope"], torch.bfloat16, "cpu")
    else:
        dp = DeviceKVPool(g["page"] * pages, g["page"], g["layers"], g["heads"], g["dk"], g["dv"], torch.bfloat16, "cpu")
    hp = host_pool_for(dp, layout="page_first_direct", host_to_device_ratio=2.0)
    for b in hp.buffers:
        t = b.as_tensor(torch.uint8, (b.nbytes,))
        t.copy_(torch.randint(0, 256, (b.nbytes,), dtype=torch.uint8))
    return hp


def _idx(ps: int, pages: range) -> torch.Tensor:
    return torch.tensor([p * ps + i for p in pages for i in range(ps)], dtype=torch.int64)


class Case(NamedTuple):
    """One case's tier on a pool of ``2 n`` pages: the tier's puts read pages ``src`` (the first n), its gets
    fill ``dst`` (the other n); ``names``, ``ptrs``, ``sizes``: raw Mooncake's objects of the same pages (as
    the tier names and places them), ``dptrs`` where a raw get puts them."""

    tier: MooncakeTier
    n: int
    src: torch.Tensor
    dst: torch.Tensor
    names: list[str]
    ptrs: list[int]
    sizes: list[int]
    dptrs: list[int]


def case(name: str, c: LocalCluster, model_name: str, keyring: Any = None) -> Case:
    """The tier and the objects of case ``name`` on cluster ``c`` (``close()`` the tier after)."""
    kind, g, n = CASES[name]
    hp = _pool(kind, g, n)
    ps = hp.page_size
    tier = MooncakeTier(c.master_address, model_name=model_name, keyring=keyring)
    tier.register_mem_pool_host(hp)
    objs = tier.page_objects
    assert objs is not None
    src, dst = _idx(ps, range(n)), _idx(ps, range(n, 2 * n))
    names, ptrs, sizes = objs.objects([f"x{i}" for i in range(n)], src.view(-1, ps)[:, 0].numpy() // ps)
    _, dptrs, _ = objs.objects([f"x{i}" for i in range(n)], dst.view(-1, ps)[:, 0].numpy() // ps)
    return Case(tier, n, src, dst, names, ptrs, sizes, dptrs)


def run_case(name: str, c: LocalCluster, reps: int, keyring: Any = None) -> dict:
    """Raw Mooncake and the tier (sealed with ``keyring`` when given) on the same pages, in turn."""
    tier, n, src, dst, names, ptrs, sizes, dptrs = case(name, c, f"bench/{name}", keyring)
    raw = tier.client
    total = sum(sizes)
    rec = record_size(len(names) // n, keyring is not None)  # one page's record
    recbuf = tier.registered_buffer(2 * n * rec, "bench record")
    rptrs, rdst = [recbuf.ptr + i * rec for i in range(n)], [recbuf.ptr + (n + i) * rec for i in range(n)]
    rows: dict[str, list[float]] = {k: [] for k in ("raw_put", "raw_get", "raw_rec_put", "raw_rec_get", "kvtier_put",
                                                   "kvtier_get", "exist", "crc32c")}
    want = tier.ranges.crc32c(names, ptrs, sizes)
    checks: list[bool] = []  # after every get, raw or kvtier: the bytes that landed are the bytes sent

    def landed() -> bool:
        return bool(tier.ranges.crc32c(names, dptrs, sizes) == want)

    for r in range(reps):
        pk = [f"kv{r}_{i}" for i in range(n)]

        def timed(row: str, call: Any, *args: Any) -> Any:
            """``call(*args)``, its rate over the batch's data bytes appended to ``rows[row]``."""
            t0 = time.perf_counter()
            out = call(*args)
            rows[row].append(total / (time.perf_counter() - t0) / 1e9)
            return out

        def raw_round(records: bool = False) -> None:
            """Mooncake's own calls on the page objects, with one record-sized object per page when
            ``records`` (then also the existence check and the checksums the tier's put makes)."""
            tag = "raw_rec" if records else "raw"
            rk, rp, rs, rd = [f"{tag}{r}_{x}" for x in names], ptrs, sizes, dptrs
            if records:
                rk, rp = rk + [f"{tag}{r}_rec{i}" for i in range(n)], rp + rptrs
                rs, rd = rs + [rec] * n, rd + rdst
            res = timed(f"{tag}_put", raw.batch_put_from, rk, rp, rs)
            got = timed(f"{tag}_get", raw.batch_get_into, rk, rd, rs)
            if any(x != 0 for x in res) or any(x != s for x, s in zip(got, rs)):
                raise RuntimeError(f"{name}: raw Mooncake refused objects ({res[:4]} ..., {got[:4]} ...)")
            if records:
                timed("exist", raw.batch_is_exist, rk)  # the existence check the tier's put makes first
                timed("crc32c", tier.ranges.crc32c, names, ptrs, sizes)  # one core, as the tier's put does
            checks.append(landed())

        def tier_round() -> None:
            ok = timed("kvtier_put", tier.batch_set_v1, pk, src)
            ok2 = timed("kvtier_get", tier.batch_get_v1, pk, dst)
            if not all(ok) or not all(ok2):
                raise RuntimeError(f"{name}: the tier refused pages ({ok.count(False)} puts, {ok2.count(False)} gets)")
            checks.append(landed())

        order = [raw_round, lambda: raw_round(records=True), tier_round]
        for step in (order if r % 2 == 0 else order[::-1]):  # alternate who goes first
            step()
        time.sleep(1.1)  # past the lease of what was read, so it can be removed
        raw.remove_all()
    tier.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    row = {"case": name, "objects_per_batch": len(names), "object_bytes": sorted(set(sizes)), "batch_bytes": total,
           **{f"{k}_GBps": round(v, 3) for k, v in med.items()},
           "put_pct": round(100 * med["kvtier_put"] / med["raw_put"], 1),
           "get_pct": round(100 * med["kvtier_get"] / med["raw_get"], 1),
           # integrity split: records as objects (raw + one record per page, % of raw) and checksumming (the
           # time one core's crc32c of the batch takes, % of the raw put's time)
           "records_put_pct": round(100 * med["raw_rec_put"] / med["raw_put"], 1),
           "records_get_pct": round(100 * med["raw_rec_get"] / med["raw_get"], 1),
           "crc_time_pct": round(100 * med["raw_put"] / med["crc32c"], 1),
           "exist_time_pct": round(100 * med["raw_put"] / med["exist"], 1),
           "all": {k: [round(x, 3) for x in v] for k, v in rows.items()}, "bit_exact": all(checks)}
    print(json.dumps({k: v for k, v in row.items() if k != "all"}), flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    ap = parser("mooncake")
    a = ap.parse_args(argv)
    unknown = [x for x in a.cases.split(",") if x not in CASES]
    if unknown:
        ap.error(f"--cases: unknown {unknown}; choose from {list(CASES)}")
    if a.reps < 1 or a.storage_nodes < 1:
        ap.error("--reps and --storage-nodes must be at least 1")
    out = out_dir(a.out)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "transport": "tcp, loopback", "rows": []}
    with LocalCluster(storage_nodes=a.storage_nodes, segment_bytes=3 << 30, lease_ttl_ms=1000) as c:
        print(f"local cluster: master {c.master_address}, {a.storage_nodes} storage process(es); logs {c.log_dir}")
        for name in a.cases.split(","):
            res["rows"].append(run_case(name, c, a.reps))
    lines = [f"# kvtier cluster tier vs raw Mooncake — {res['date']} — {res['transport']}", "",
             "| case | batch | raw put | kvtier put | % | raw get | kvtier get (verified) | % | exact |",
             "|---|---|---|---|---|---|---|---|---|"]
    split = ["", "What integrity costs: raw Mooncake with one record-sized object per page (% of raw), one core's "
             "crc32c of the batch (GB/s; its time as % of the raw put's), and the existence check of data and "
             "records a put makes first (its time as % of the raw put's).", "",
             "| case | records: put % of raw | records: get % of raw | crc32c GB/s | crc32c time, % of raw put | "
             "existence check, % of raw put |", "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        sz = "+".join(f"{s >> 10} KiB" for s in r["object_bytes"])
        lines.append(f"| {r['case']} | {r['objects_per_batch']} x {sz} | {r['raw_put_GBps']} GB/s | {r['kvtier_put_GBps']} GB/s | "
                     f"{r['put_pct']}% | {r['raw_get_GBps']} GB/s | {r['kvtier_get_GBps']} GB/s | {r['get_pct']}% | {r['bit_exact']} |")
        split.append(f"| {r['case']} | {r['records_put_pct']}% | {r['records_get_pct']}% | {r['crc32c_GBps']} | "
                     f"{r['crc_time_pct']}% | {r['exist_time_pct']}% |")
    md = "\n".join(lines + split) + "\n"
    print(md)
    if out is not None:
        write_results(out, {"cpu-mooncake.json": json.dumps(res, indent=1), "cpu-mooncake.md": md})
        print(f"results in {out}/cpu-mooncake.json and .md")


if __name__ == "__main__":
    main()
