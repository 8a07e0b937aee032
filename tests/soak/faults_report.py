"""The fault-injection runs of tests/test_faults.py as a table: for each fault, the demo workload (9 multi-turn
requests through TierController and PageStore, verified against a fresh recomputation) and what the stats
say. `python tests/soak/faults_report.py` — the figures in docs/RELIABILITY.md. The workload is the demo's,
imported from the checkout (examples/kvtier_demo)."""

import errno
import sys
import time
from pathlib import Path

from kvtier import testing

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

CASES = [
    ("none", None, None, {}),
    ("EIO on every object write", "data_write", "error", dict(errno=errno.EIO)),
    ("short writes (half, then EIO)", "data_write", "short", dict(errno=errno.EIO)),
    ("torn writes (half, reported OK)", "data_write", "torn", {}),
    ("ENOSPC on fallocate", "fallocate", "error", dict(errno=errno.ENOSPC)),
    ("EIO on data fsync", "data_sync", "error", dict(errno=errno.EIO)),
    ("ENOSPC on journal fsync", "journal_sync", "error", dict(errno=errno.ENOSPC)),
    ("EIO on every read", "data_read", "error", dict(errno=errno.EIO)),
    ("slow disk (reads +20 ms, writes +5 ms)", "data_read", "delay", dict(delay_ms=20)),
]


def main() -> int:
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    from kvtier_demo.workload import run_workload

    print("| fault | requests | bit-exact | sources | store writes ok / failed | reads ok / failed / corrupt | faults hit | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    bad = 0
    for name, point, kind, kw in CASES:
        testing.clear_faults()
        if point:
            testing.inject_fault(point, kind, times=None, **kw)
        if kind == "delay":
            testing.inject_fault("data_write", "delay", delay_ms=5, times=None)
        t0 = time.time()
        out = run_workload(device="cpu", quiet=True)
        hits = testing.fault_hits(point) if point else 0
        testing.clear_faults()
        st, s = out["stats"], out["store"]
        src = {}
        for r in out["results"]:
            src[r["source"]] = src.get(r["source"], 0) + 1
        ok = not out["failures"]
        bad += not ok
        print(f"| {name} | {len(out['results'])} | {ok} | {', '.join(f'{k} {v}' for k, v in sorted(src.items()))} | "
              f"{st.store_writes} / {st.store_write_failures} | {s['hits']} / {s['read_failures']} / {s['corrupt_reads']} | "
              f"{hits} | {time.time() - t0:.1f} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
