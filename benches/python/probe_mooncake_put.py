"""Where the cluster tier's put and get time goes beside raw Mooncake's, for the cases of ``kvtier bench
mooncake``: per round, raw ``batch_put_from`` / ``batch_get_into`` of the page objects, then the tier's
``batch_set_v1`` / ``batch_get_v1`` of the same pages (fresh keys each round, who goes first alternating),
with every call the tier makes to Mooncake and to its checksums timed from outside (a proxy in front of the
tier's client and of its ``HostRanges``):

- ``store``: the tier's Mooncake calls (for a put: the existence check, then ``batch_put_from``; for a get:
  ``batch_get_into``), each named;
- ``crc32c``: the tier's checksums of the batch (``HostRanges.crc32c``: summed on several threads);
- ``rest``: the tier's own Python (records, bookkeeping) = the call's time less the two above.

Medians over ``--reps`` rounds, in ms per batch, and each part as % of the raw call's time.

    PYTHONPATH=python python benches/python/probe_mooncake_put.py [--cases 4MiB,mimo-kv] [--reps 7] [--out F]

Starts a local cluster (a master and one storage process on 127.0.0.1) and stops it at the end."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from kvtier_bench.mooncake import CASES, case
from kvtier.tiers.local_cluster import LocalCluster


class Timed:
    """Forwards every attribute to ``inner``; calls of the methods named in ``names`` add their seconds to
    ``spent[name]``."""

    def __init__(self, inner: Any, names: tuple[str, ...], spent: dict[str, float]) -> None:
        self._inner, self._names, self._spent = inner, names, spent

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._inner, name)
        if name not in self._names:
            return fn

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self._spent[name] = self._spent.get(name, 0.0) + time.perf_counter() - t0
        return timed


STORE_CALLS = ("batch_is_exist", "batch_put_from", "batch_upsert_from", "batch_get_into", "remove")


def run_case(name: str, c: LocalCluster, reps: int) -> dict:
    tier, n, src, dst, names, ptrs, sizes, dptrs = case(name, c, f"probe/{name}")
    raw = tier.client
    spent: dict[str, float] = {}
    tier._store = Timed(raw, STORE_CALLS, spent)
    tier._ranges = Timed(tier._ranges, ("crc32c",), spent)
    rows: dict[str, list[float]] = {}

    def add(key: str, s: float) -> None:
        rows.setdefault(key, []).append(s * 1e3)

    for r in range(reps):
        def raw_round(r: int = r) -> None:
            keys = [f"raw{r}_{x}" for x in names]
            t0 = time.perf_counter()
            raw.batch_put_from(keys, ptrs, sizes)
            add("raw_put", time.perf_counter() - t0)
            t0 = time.perf_counter()
            raw.batch_get_into(keys, dptrs, sizes)
            add("raw_get", time.perf_counter() - t0)

        def tier_round(r: int = r) -> None:
            pk = [f"kv{r}_{i}" for i in range(n)]
            for op, call, idx in (("put", tier.batch_set_v1, src), ("get", tier.batch_get_v1, dst)):
                spent.clear()
                t0 = time.perf_counter()
                ok = call(pk, idx)
                total = time.perf_counter() - t0
                if not all(ok):
                    raise RuntimeError(f"{name}: the tier refused {ok.count(False)} pages in its {op}")
                add(f"tier_{op}", total)
                for k, v in spent.items():
                    add(f"tier_{op}.{k}", v)
                add(f"tier_{op}.rest", total - sum(spent.values()))

        for step in ((raw_round, tier_round) if r % 2 == 0 else (tier_round, raw_round)):
            step()
        time.sleep(1.1)  # past the lease of what was read, so it can be removed
        raw.remove_all()
    tier.close()
    med = {k: round(statistics.median(v), 2) for k, v in rows.items()}
    share = {k: round(100 * v / med["raw_" + k.split(".")[0][5:]], 1) for k, v in med.items() if k.startswith("tier_")}
    return {"case": name, "pages": n, "batch_bytes": sum(sizes), "ms": med, "pct_of_raw": share, "reps": reps}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="4MiB,mimo-kv,deepseek-latent")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None, help="a JSON file for the rows")
    args = ap.parse_args()
    cases = [x for x in args.cases.split(",") if x]
    if any(x not in CASES for x in cases):
        ap.error(f"--cases: choose from {list(CASES)}")
    if args.reps < 1:
        ap.error("--reps: at least 1")
    out = []
    with LocalCluster(storage_nodes=1, segment_bytes=3 << 30, lease_ttl_ms=1000) as c:
        for name in cases:
            row = run_case(name, c, args.reps)
            out.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
