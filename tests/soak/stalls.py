"""Chaos soak of the deadlines: request threads serve multi-turn conversations through a ``TierController``
(device → host → disk, write-through) while a chaos thread injects, at random, episodes of a hung disk (reads,
writes or both stalled until released), failing IO (EIO reads, a full disk) and a slow disk. Every page that
reaches the device is compared with what it must hold.

    python tests/soak/stalls.py --seconds 1800 [--threads 4] [--deadline 0.2] [--out stalls.json]

It reports, per request, the time the request waited on the tier (its lookup and its prefetch: what the deadlines
bound) against its budget (the lookup deadline + the restore deadline), requests stuck past twice the budget,
wrong bytes (divergences), deadline misses, the breaker's trips and recoveries, and the fenced pages once the last
episode has ended (they must come back to 0). Exit status 1 on a divergence, a stuck request or a page left
fenced. Without ``--chaos`` off (``--no-chaos``) it is the same workload with no fault: the baseline.
"""

from __future__ import annotations

import argparse
import errno
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from kvtier import DeviceKVPool, InvalidArgumentError, PageStore, TierController, host_pool_for, testing
from kvtier.deadlines import Breaker

PS, LAYERS, HEADS, K, V = 4, 2, 2, 8, 6
EPISODES = [
    ("stall reads", [("data_read", "stall", {})]),
    ("stall writes", [("data_write", "stall", {})]),
    ("stall reads and writes", [("data_read", "stall", {}), ("data_write", "stall", {})]),
    ("EIO reads", [("data_read", "error", dict(errno=errno.EIO))]),
    ("disk full", [("fallocate", "error", dict(errno=errno.ENOSPC))]),
    ("slow disk", [("data_read", "delay", dict(delay_ms=30)), ("data_write", "delay", dict(delay_ms=10))]),
]


def page_value(conv: int, page: int) -> float:
    return float(conv * 100 + page + 1)  # exact in float32 (below 2**24 for 40 hours of new conversations)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--deadline", type=float, default=0.2, help="restore and lookup deadline, seconds")
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--no-chaos", action="store_true", help="the same workload with no fault (the baseline)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None, help="store directory (default: a temporary one)")
    ap.add_argument("--out", default=None, help="write the report as JSON here")
    a = ap.parse_args(argv)
    if a.threads < 1 or a.seconds <= 0 or a.deadline <= 0:
        raise InvalidArgumentError("invalid argument: --threads >= 1, --seconds > 0 and --deadline > 0")
    root = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="kvtier-stalls-"))
    slots = 16  # device pages per thread
    dp = DeviceKVPool(a.threads * slots * PS, PS, LAYERS, HEADS, K, V, torch.float32, "cpu")
    per_page = PS * LAYERS * (K + V) * HEADS * 4
    hp = host_pool_for(dp, host_size_gb=40 * per_page / 1e9, layout="page_first_direct")
    store = PageStore(root, capacity_bytes=1 << 26)
    store.register_mem_pool_host(hp)
    ctl = TierController(dp, hp, store, restore_deadline=a.deadline, lookup_deadline_s=a.deadline,
                         write_deadline_s=2 * a.deadline, breaker=Breaker(threshold=2, cooldown_s=0.5), probe=False)
    budget = 2 * a.deadline
    waits: list[float] = []
    report = {"requests": 0, "divergences": 0, "stuck": 0, "load_races": 0, "pages_from_host": 0,
              "pages_recomputed": 0, "episodes": {}}
    lock = threading.Lock()
    start = time.monotonic()
    stop = start + a.seconds

    def rows(t: int, n: int) -> torch.Tensor:
        base = t * slots * PS
        return torch.arange(base, base + n * PS, dtype=torch.int64)

    def fill(t: int, conv: int, first: int, n: int) -> None:  # "recompute": the pages' KV on the device
        for j in range(n):  # page first + j into the thread's device page j
            r = rows(t, n)[j * PS:(j + 1) * PS]
            for layer in range(LAYERS):
                dp.k_buffer[layer][r] = page_value(conv, first + j) + layer
                dp.v_buffer[layer][r] = -page_value(conv, first + j) - layer

    def serve(t: int) -> None:
        rng = random.Random(a.seed * 1000 + t)
        while time.monotonic() < stop:
            # new conversations keep arriving (4 every 5 s), so writes keep reaching the disk
            conv = int((time.monotonic() - start) / 5) * 4 + rng.randrange(a.conversations)
            n = rng.randint(2, slots)  # this turn's prefix: pages 0..n-1 of the conversation
            keys = [f"c{conv}-p{j}" for j in range(n)]
            t0 = time.monotonic()
            host, disk = ctl.match(keys)
            if disk:
                ctl.prefetch(keys[: host + disk]).result()
            waited = time.monotonic() - t0
            have = ctl.match(keys)[0]
            bad = 0
            if have:
                try:
                    ld = ctl.load(keys[:have], rows(t, have))
                    ld.synchronize()
                    for j in range(have):
                        r = rows(t, have)[j * PS:(j + 1) * PS]
                        for layer in range(LAYERS):
                            want = page_value(conv, j) + layer
                            bad += int(not bool((dp.k_buffer[layer][r] == want).all()))
                            bad += int(not bool((dp.v_buffer[layer][r] == -want).all()))
                except InvalidArgumentError:  # evicted by another thread between match and load: recompute
                    have = 0
                    with lock:
                        report["load_races"] += 1
            # the rest is "recomputed" on the device and backed up (written through)
            if n > have:
                fill(t, conv, have, n - have)
                ctl.backup(rows(t, n - have), keys[have:])
            with lock:
                waits.append(waited)
                report["requests"] += 1
                report["divergences"] += bad
                report["stuck"] += waited > 2 * budget
                report["pages_from_host"] += have
                report["pages_recomputed"] += n - have

    def chaos() -> None:
        rng = random.Random(a.seed)
        while time.monotonic() < stop:
            time.sleep(rng.uniform(0.5, 3.0))
            name, faults = rng.choice(EPISODES)
            for point, kind, kw in faults:
                testing.inject_fault(point, kind, times=None, **kw)
            time.sleep(min(rng.uniform(0.5, 4.0), max(0.0, stop - time.monotonic())))
            testing.clear_faults()
            report["episodes"][name] = report["episodes"].get(name, 0) + 1

    threads = [threading.Thread(target=serve, args=(t,), daemon=True) for t in range(a.threads)]
    if not a.no_chaos:
        threads.append(threading.Thread(target=chaos, daemon=True))
    last = time.monotonic()
    for th in threads:
        th.start()
    while any(th.is_alive() for th in threads):
        time.sleep(0.5)
        ctl.wait_idle()  # (the controller's answered calls, let go of: only this thread waits on them)
        if time.monotonic() - last >= 30:
            last = time.monotonic()
            with lock:
                print(f"[{a.seconds - max(0.0, stop - last):.0f}/{a.seconds:.0f} s] requests {report['requests']}, "
                      f"divergences {report['divergences']}, stuck {report['stuck']}, "
                      f"deadline misses {sum(ctl.deadline_stats()['deadline_misses'].values())}", file=sys.stderr)
        if time.monotonic() > stop + 10 * budget + 60:
            report["stuck"] += sum(th.is_alive() for th in threads)
            break
    testing.clear_faults()
    t_end = time.monotonic()
    while ctl.deadline_stats()["stuck_calls"] and time.monotonic() - t_end < 60:
        time.sleep(0.05)
    ds = ctl.deadline_stats()
    w = sorted(waits) or [0.0]

    def pct(p: float) -> float:
        return w[min(len(w) - 1, int(p * len(w)))]

    report.update(seconds=a.seconds, threads=a.threads, deadline_s=a.deadline, budget_s=budget,
                  wait_p50_s=pct(0.5), wait_p99_s=pct(0.99), wait_p999_s=pct(0.999), wait_max_s=w[-1],
                  over_budget_plus_50ms=sum(x > budget + 0.05 for x in w), fenced_at_end=ds["fenced_pages"],
                  stuck_calls_at_end=ds["stuck_calls"], deadline=ds, controller=vars(ctl.stats),
                  store={k: v for k, v in store.get_stats().items() if isinstance(v, (int, float))})
    ctl.close()
    store.close()
    print(json.dumps({k: v for k, v in report.items() if k not in ("controller", "store")}, indent=1, default=str))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1, default=str))
    ok = not report["divergences"] and not report["stuck"] and not ds["fenced_pages"] and not ds["stuck_calls"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
