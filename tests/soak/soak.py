"""Soak test: several threads in each of several processes drive random mixes of host-page alloc/free, device
→ host backups, host → device loads, store set/get/exists/delete (with LRU eviction) and store reopen against
the real components, and check every byte against an in-memory model of what each page must contain.

    python tests/soak/soak.py --seconds 120 --procs 2 --threads 4 [--out results.json] [--device cpu] [--disk-full]

Each process serves its own namespace in one shared store directory (two processes, one directory, as
tensor-parallel ranks do), and one more thread per process drives a ``TierController`` (backup, match, prefetch
from the store, per-layer load) over its own pools and namespace, checking every loaded page. Process 0's store
is small, so pages are evicted and a miss is legitimate; the
others' stores are large enough that a miss of an acknowledged page is a divergence (a lost page). Wrong
bytes anywhere, a deleted or never-written key that reads back, or an exception are divergences. RSS and
open file descriptors are sampled after a warm-up and at the end; they must stay flat (the store's own
files, opened per size class and again after each reopen, are held to a fixed bound instead). Prints one line per
process and a summary; writes JSON with ``--out``; exits 1 on any divergence or growth.

``--disk-full`` (root only) puts the store on a small tmpfs and fills that file system completely for a
moment every few seconds (a filler file, then removed): writes then fail (False, never an exception),
deletes must still work (the store prepays them), and no acknowledged page may be lost or read back wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import numpy as np

PS, LAYERS, HEADS, DK, DV = 16, 4, 2, 48, 32  # MiMo's K 192 / V 128, scaled down by 4


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def open_fds(root: str) -> tuple[int, int, list[str]]:
    """(descriptors outside the store directory, descriptors of files inside it, the outside ones' targets). The
    store opens one file per object size class lazily (and again after a reopen), so its own count moves between
    bounds; every other descriptor must stay flat."""
    other, store = [], 0
    root = os.path.realpath(root)
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor)
        if target.startswith(root + os.sep):
            store += 1
        else:
            other.append(target)
    return len(other), store, sorted(other)


def steady_fds(root: str, samples: int = 10, gap_s: float = 0.02) -> tuple[int, int, list[str]]:
    """:func:`open_fds` at the fewest outside descriptors over ``samples`` looks ``gap_s`` apart: a descriptor a
    background thread holds for an instant is not a leak; a leaked one is there at every look."""
    seen = []
    for i in range(samples):
        if i:
            time.sleep(gap_s)
        seen.append(open_fds(root))
    return min(seen, key=lambda x: x[0])


#: descriptors outside the store that may first open after the warm-up, once (a lazily made singleton: a process
#: had 4 at warm-up where the other had 3 and then 4); a leak repeats with the thousands of operations
LAZY_FDS = 2


def fd_leak(before: list[str], after: list[str]) -> str | None:
    """Why the outside descriptors ``after`` (targets) look leaked against ``before``, or None: a target held more
    times than at warm-up, or more than :data:`LAZY_FDS` new ones."""
    grew = [t for t in set(after) if before.count(t) and after.count(t) > before.count(t)]
    if grew or len(after) - len(before) > LAZY_FDS:
        new = list(after)
        for t in before:
            if t in new:
                new.remove(t)
        return f"open fds grew {len(before)} -> {len(after)} (new: {new[:8]})"
    return None


class RWLock:
    """Shared for store calls (they run concurrently, as in a server), exclusive for reopen."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False

    def shared(self):
        lock = self

        class _Shared:
            def __enter__(self):
                with lock._cond:
                    while lock._writer:
                        lock._cond.wait()
                    lock._readers += 1

            def __exit__(self, *exc):
                with lock._cond:
                    lock._readers -= 1
                    lock._cond.notify_all()

        return _Shared()

    def __enter__(self):
        with self._cond:
            while self._writer or self._readers:
                self._cond.wait()
            self._writer = True

    def __exit__(self, *exc):
        with self._cond:
            self._writer = False
            self._cond.notify_all()


def content(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


class Worker:
    def __init__(self, rank: int, root: str, threads: int, device: str, seed: int) -> None:
        import torch

        import kvtier

        self.torch, self.kvtier = torch, kvtier
        self.rank, self.root, self.nthreads, self.device = rank, root, threads, device
        self.rows_per_thread = 4 * PS  # 4 device pages per thread
        size = threads * self.rows_per_thread
        self.dp = kvtier.DeviceKVPool(size, PS, LAYERS, HEADS, DK, DV, torch.bfloat16, device)
        self.hp = kvtier.host_pool_for(self.dp, host_to_device_ratio=2.0, layout="page_first_direct",
                                       pin_memory=device == "cuda")
        self.page_k = LAYERS * PS * HEADS * DK * 2
        self.page_v = LAYERS * PS * HEADS * DV * 2
        self.evicting = rank == 0
        # process 0: room for 8 pages (evicts); others: far more than they can ever write in a run
        self.capacity = 8 * (self.page_k + self.page_v) if self.evicting else 1 << 34
        self.model_name = f"soak-{rank}"
        self.store_lock = RWLock()  # reopen swaps the store: exclusive; store calls: shared
        self.store = self._open_store()
        self.counts: dict[str, int] = {}
        self.evictions = 0  # summed over reopens (a store's counters start at zero)
        self.write_failures = 0  # likewise
        self.bytes = 0
        self.divergences: list[str] = []
        self.rng = random.Random(seed)
        self.lock = threading.Lock()

    def _open_store(self):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the O_DIRECT fallback note on file systems without it
            st = self.kvtier.PageStore(self.root, capacity_bytes=self.capacity, model_name=self.model_name, io_threads=4)
            st.register_mem_pool_host(self.hp)
        return st

    # -- helpers ---------------------------------------------------------------------------------------
    def count(self, op: str, nbytes: int = 0) -> None:
        with self.lock:
            self.counts[op] = self.counts.get(op, 0) + 1
            self.bytes += nbytes

    def diverge(self, msg: str) -> None:
        with self.lock:
            self.divergences.append(msg)

    def host_page(self, page: int):
        """(K bytes, V bytes) of host page ``page`` as numpy views."""
        t = self.torch
        k = self.hp.k_buffer[page].reshape(-1).view(t.uint8).numpy()
        v = self.hp.v_buffer[page].reshape(-1).view(t.uint8).numpy()
        return k, v

    def device_rows(self, first_row: int, seed: int, write: bool, pool=None):
        """Write (or compare) the K/V content of seed ``seed`` into the device rows of one page."""
        t = self.torch
        dp = self.dp if pool is None else pool
        ks, vs = content(seed, self.page_k), content(seed + 1, self.page_v)
        ok = True
        for layer in range(LAYERS):
            kk = ks[layer * PS * HEADS * DK * 2 : (layer + 1) * PS * HEADS * DK * 2]
            vv = vs[layer * PS * HEADS * DV * 2 : (layer + 1) * PS * HEADS * DV * 2]
            kd = dp.k_buffer[layer][first_row : first_row + PS].view(t.uint8)
            vd = dp.v_buffer[layer][first_row : first_row + PS].view(t.uint8)
            if write:
                kd.copy_(t.from_numpy(kk.copy()).view(kd.shape))
                vd.copy_(t.from_numpy(vv.copy()).view(vd.shape))
            else:
                ok &= bool(np.array_equal(kd.cpu().reshape(-1).numpy(), kk)) and bool(np.array_equal(vd.cpu().reshape(-1).numpy(), vv))
        return ok

    def host_matches(self, page: int, seed: int) -> bool:
        k, v = self.host_page(page)
        return bool(np.array_equal(k, content(seed, self.page_k))) and bool(np.array_equal(v, content(seed + 1, self.page_v)))

    # -- one thread --------------------------------------------------------------------------------------
    def run_thread(self, tid: int, deadline: float) -> None:
        t = self.torch
        rng = random.Random(self.rng.random() + tid)
        base_row = PS + tid * self.rows_per_thread  # rows [0, PS) are the padding page
        owned: dict[int, int | None] = {}  # host page -> content seed (None: unknown)
        stored: dict[str, int] = {}  # key -> seed acknowledged by the store
        gone: set[str] = set()  # deleted keys
        serial = 0
        sync = t.cuda.synchronize if self.device == "cuda" else (lambda: None)

        def pages_tensor(pages):
            return t.tensor([p * PS + i for p in pages for i in range(PS)], dtype=t.int64)

        def rows_tensor(n):
            return t.arange(base_row, base_row + n * PS, dtype=t.int64)

        while time.monotonic() < deadline:
            op = rng.choice(["alloc", "free", "backup", "backup", "load", "set", "set", "get", "get", "exists",
                             "delete", "reopen" if tid == 0 else "get"])
            try:
                if op == "alloc" or not owned:
                    got = self.hp.alloc(PS * rng.randint(1, 3))
                    if got is not None:
                        for p in sorted({int(x) // PS for x in got}):
                            owned[p] = None
                    self.count("alloc" if got is not None else "alloc_refused_full")
                elif op == "free":
                    victims = rng.sample(sorted(owned), k=min(len(owned), rng.randint(1, 2)))
                    self.hp.free(pages_tensor(victims))
                    for p in victims:
                        del owned[p]
                    self.count("free")
                elif op == "backup":
                    pages = rng.sample(sorted(owned), k=min(len(owned), rng.randint(1, 4)))
                    seeds = []
                    for j, _ in enumerate(pages):
                        serial += 1
                        s = (self.rank << 48) | (tid << 32) | (serial << 1)
                        self.device_rows(base_row + j * PS, s, write=True)
                        seeds.append(s)
                    self.hp.backup_from_device_all_layer(self.dp, pages_tensor(pages), rows_tensor(len(pages)), "direct")
                    sync()
                    for p, s in zip(pages, seeds):
                        owned[p] = s
                        if not self.host_matches(p, s):
                            self.diverge(f"backup: host page {p} differs from device content {s}")
                    self.count("backup", len(pages) * (self.page_k + self.page_v))
                elif op == "load":
                    known = [p for p, s in owned.items() if s is not None]
                    if not known:
                        continue
                    pages = rng.sample(known, k=min(len(known), rng.randint(1, 4)))
                    for layer in range(LAYERS):
                        self.hp.load_to_device_per_layer(self.dp, pages_tensor(pages), rows_tensor(len(pages)), layer, "direct")
                    sync()
                    for j, p in enumerate(pages):
                        if not self.device_rows(base_row + j * PS, owned[p], write=False):
                            self.diverge(f"load: device rows of host page {p} differ from content {owned[p]}")
                    self.count("load", len(pages) * (self.page_k + self.page_v))
                elif op == "set":
                    known = [p for p, s in owned.items() if s is not None]
                    if not known:
                        continue
                    pages = rng.sample(known, k=min(len(known), rng.randint(1, 4)))
                    keys = [f"r{self.rank}t{tid}s{owned[p]}" for p in pages]
                    with self.store_lock.shared():
                        ok = self.store.batch_set_v1(keys, pages_tensor(pages))
                    for k, p, good in zip(keys, pages, ok):
                        if good:
                            stored[k] = owned[p]
                            gone.discard(k)
                    self.count("set", sum(ok) * (self.page_k + self.page_v))
                elif op == "get":
                    if not stored:
                        continue
                    keys = rng.sample(sorted(stored), k=min(len(stored), rng.randint(1, 3)))
                    if gone and rng.random() < 0.3:
                        keys.append(rng.choice(sorted(gone)))
                    if rng.random() < 0.2:
                        keys.append(f"r{self.rank}t{tid}never{serial}")
                    if len(owned) < len(keys):
                        continue
                    pages = rng.sample(sorted(owned), k=len(keys))
                    with self.store_lock.shared():
                        ok = self.store.batch_get_v1(keys, pages_tensor(pages))
                    for k, p, good in zip(keys, pages, ok):
                        if k in stored:
                            if good:
                                owned[p] = stored[k]
                                if not self.host_matches(p, stored[k]):
                                    self.diverge(f"get: {k} read back wrong bytes")
                            else:
                                owned[p] = None  # a miss may have left anything in the page
                                if not self.evicting:
                                    self.diverge(f"get: acknowledged {k} lost (store never evicts here)")
                                stored.pop(k, None)
                        else:
                            owned[p] = None
                            if good:
                                self.diverge(f"get: {k} (deleted or never written) read back")
                    self.count("get", sum(ok) * (self.page_k + self.page_v))
                elif op == "exists":
                    keys = sorted(stored)[:8] + sorted(gone)[:4]
                    if not keys:
                        continue
                    with self.store_lock.shared():
                        n = self.store.batch_exists(keys)
                        present = [self.store.exists(k) for k in keys]
                    for k, there in zip(keys, present):
                        if k in gone and there:
                            self.diverge(f"exists: deleted {k} is present")
                        if k in stored and not there and not self.evicting:
                            self.diverge(f"exists: acknowledged {k} missing (store never evicts here)")
                    if n > len(keys):
                        self.diverge(f"batch_exists returned {n} for {len(keys)} keys")
                    self.count("exists")
                elif op == "delete":
                    if not stored:
                        continue
                    keys = rng.sample(sorted(stored), k=min(len(stored), rng.randint(1, 2)))
                    with self.store_lock.shared():
                        self.store.delete(keys)
                    for k in keys:
                        stored.pop(k)
                        gone.add(k)
                    self.count("delete")
                elif op == "reopen":
                    with self.store_lock:
                        st = self.store.get_stats()
                        self.evictions += st["evictions"]
                        self.write_failures += st["write_failures"]
                        self.store.close()
                        self.store = self._open_store()
                    self.count("reopen")
            except Exception:  # noqa: BLE001 - every exception is a finding
                self.diverge(f"{op}: exception\n{traceback.format_exc()}")
                return

    def run_controller(self, deadline: float) -> None:
        """One scheduler thread driving a TierController (its own pools and namespace): backups of pages
        whose content is a function of their key, then match / prefetch from the store / per-layer load of
        random prefixes, every loaded page checked. The host pool holds 6 pages of a 24-key universe, so pages
        are evicted to the store and prefetched back all the time."""
        import zlib

        t, kvtier = self.torch, self.kvtier
        rng = random.Random(self.rng.random())
        cdp = kvtier.DeviceKVPool(8 * PS, PS, LAYERS, HEADS, DK, DV, t.bfloat16, self.device)
        chp = kvtier.host_pool_for(cdp, host_to_device_ratio=0.75, layout="page_first_direct", pin_memory=self.device == "cuda")
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cstore = kvtier.PageStore(self.root, capacity_bytes=1 << 34, model_name=f"soak-ctrl-{self.rank}", io_threads=4)
            cstore.register_mem_pool_host(chp)
        ctrl = kvtier.TierController(cdp, chp, cstore, io_backend="direct")
        universe = [f"ctrl{self.rank}-{i}" for i in range(24)]

        def seed_of(key: str) -> int:
            return zlib.crc32(key.encode()) << 1

        sync = t.cuda.synchronize if self.device == "cuda" else (lambda: None)
        try:
            while time.monotonic() < deadline:
                keys = rng.sample(universe, rng.randint(1, 4))
                rows = t.arange(PS, PS + len(keys) * PS, dtype=t.int64)
                if rng.random() < 0.4:
                    for j, k in enumerate(keys):
                        self.device_rows(PS + j * PS, seed_of(k), write=True, pool=cdp)
                    ctrl.backup(rows, keys)
                    ctrl.wait_idle()
                    self.count("ctrl_backup", len(keys) * (self.page_k + self.page_v))
                    continue
                host, disk = ctrl.match(keys)
                if disk:
                    ctrl.prefetch(keys[: host + disk]).result()
                    self.count("ctrl_prefetch")
                have, _ = ctrl.match(keys)
                if have:
                    for j in range(have):  # poison first: a load that moved nothing must not pass
                        self.device_rows(PS + j * PS, 1, write=True, pool=cdp)
                    load = ctrl.load(keys[:have], rows[: have * PS])
                    for layer in range(LAYERS):
                        load.wait(layer)
                    load.synchronize()
                    sync()
                    for j, k in enumerate(keys[:have]):
                        if not self.device_rows(PS + j * PS, seed_of(k), write=False, pool=cdp):
                            self.diverge(f"controller: {k} loaded wrong bytes")
                    self.count("ctrl_load", have * (self.page_k + self.page_v))
                ctrl.wait_idle()
        except Exception:  # noqa: BLE001 - every exception is a finding
            self.diverge(f"controller: exception\n{traceback.format_exc()}")
        finally:
            ctrl.close()
            with self.lock:
                self.ctrl_stats = dict(vars(ctrl.stats))
            cstore.close()
            chp.close()

    def run(self, seconds: float) -> dict:
        open(os.path.join(self.root, f".ready-{self.rank}"), "w").close()  # stores open: --disk-full may begin
        t0 = time.monotonic()
        warm_end = t0 + max(1.0, 0.25 * seconds)
        deadline = t0 + seconds
        threads = [threading.Thread(target=self.run_thread, args=(i, deadline)) for i in range(self.nthreads)]
        threads.append(threading.Thread(target=self.run_controller, args=(deadline,)))
        for th in threads:
            th.start()
        while time.monotonic() < warm_end:
            time.sleep(0.05)
        rss0, (fds0, store_fds0, fd_targets0) = rss_bytes(), steady_fds(self.root)
        for th in threads:
            th.join()
        rss1, (fds1, store_fds1, fd_targets1) = rss_bytes(), steady_fds(self.root)  # the store is open at both
        with self.store_lock:
            stats = self.store.get_stats()
            self.evictions += stats["evictions"]
            self.write_failures += stats["write_failures"]
            self.store.close()
        self.hp.close()
        return dict(rank=self.rank, seconds=round(time.monotonic() - t0, 1), threads=self.nthreads,
                    ops=sum(self.counts.values()), counts=self.counts, bytes_moved=self.bytes,
                    divergences=self.divergences, rss_after_warmup=rss0, rss_end=rss1, fds_after_warmup=fds0,
                    fds_end=fds1, fd_targets_after_warmup=fd_targets0, fd_targets_end=fd_targets1, store_fds_after_warmup=store_fds0, store_fds_end=store_fds1, store_evictions=self.evictions, store_corrupt_reads=stats["corrupt_reads"],
                    store_write_failures=self.write_failures,
                    store_pages=stats["pages"], controller=getattr(self, "ctrl_stats", None))


class DiskFull:
    """A 96 MiB tmpfs mounted over the store root, filled to the last byte for 0.3–1.5 s every 1–3 s."""

    def __init__(self, root: str, seconds: float) -> None:
        self.root, self.seconds, self.episodes = root, seconds, 0
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96m,mode=0700", "tmpfs", root],
                           capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"--disk-full needs root to mount a tmpfs: {r.stderr.strip()}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        rng = random.Random(7)
        filler = os.path.join(self.root, "filler")
        deadline = time.monotonic() + self.seconds
        chunk = b"\xa5" * (1 << 20)
        while not self._stop.wait(rng.uniform(1.0, 3.0)) and time.monotonic() < deadline:
            with open(filler, "wb", buffering=0) as f:
                try:
                    while True:
                        f.write(chunk)
                except OSError:
                    pass
                try:  # the last partial MiB
                    for _ in range(256):
                        f.write(chunk[:4096])
                except OSError:
                    pass
            st = os.statvfs(self.root)
            if st.f_bavail * st.f_frsize < (64 << 10):  # really full
                self.episodes += 1
            self._stop.wait(rng.uniform(0.3, 1.5))
            os.unlink(filler)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", self.root], capture_output=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=float(os.environ.get("SOAK_SECONDS", 120)))
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--root", default=None, help="store directory (default: a temporary one)")
    ap.add_argument("--torn-writes", action="store_true",
                    help="self-check: inject torn object writes (kvtier.testing); the soak must then report lost pages")
    ap.add_argument("--disk-full", action="store_true",
                    help="store on a 96 MiB tmpfs that is filled completely for a moment every few seconds (root only)")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rss-slack-mb", type=float, default=64.0, help="RSS growth allowed after warm-up")
    args = ap.parse_args(argv)
    if args.worker is not None:
        if args.torn_writes:
            from kvtier import testing

            testing.inject_fault("data_write", "torn", skip=50, times=None)
        res = Worker(args.worker, args.root, args.threads, args.device, args.seed + args.worker).run(args.seconds)
        print(json.dumps(res), flush=True)
        return 0
    for name in ("seconds", "procs", "threads"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name} must be positive")
    root = args.root or tempfile.mkdtemp(prefix="kvtier-soak-")
    full = DiskFull(root, args.seconds) if args.disk_full else None
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(r), "--root", root,
                               "--seconds", str(args.seconds), "--threads", str(args.threads), "--device", args.device,
                               "--seed", str(args.seed)] + (["--torn-writes"] if args.torn_writes else []), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(args.procs)]
    if full:
        # the namespaces must exist before the disk fills (creating one on a full disk fails, as it should)
        t_ready = time.monotonic() + 180
        while time.monotonic() < t_ready and not all(os.path.exists(os.path.join(root, f".ready-{r}"))
                                                     for r in range(args.procs)):
            time.sleep(0.1)
        full.start()
    results, failures = [], []
    for r, p in enumerate(procs):
        out, err = p.communicate(timeout=args.seconds * 3 + 300)
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if p.returncode != 0 or not lines:
            failures.append(f"process {r} exited {p.returncode}: {err[-3000:]}")
            continue
        results.append(json.loads(lines[-1]))
    for res in results:
        growth = (res["rss_end"] - res["rss_after_warmup"]) / 2**20
        print(f"process {res['rank']}: {res['ops']} ops in {res['seconds']} s on {res['threads']} threads, "
              f"{res['bytes_moved'] / 1e6:.1f} MB moved, {len(res['divergences'])} divergences, RSS "
              f"{res['rss_after_warmup'] / 2**20:.0f} -> {res['rss_end'] / 2**20:.0f} MiB, fds {res['fds_after_warmup']} -> "
              f"{res['fds_end']} (store files {res['store_fds_after_warmup']} -> {res['store_fds_end']}), evictions {res['store_evictions']}, ops {res['counts']}")
        failures += [f"process {res['rank']}: {d}" for d in res["divergences"]]
        if growth > args.rss_slack_mb:
            failures.append(f"process {res['rank']}: RSS grew {growth:.0f} MiB after warm-up")
        if (leak := fd_leak(res["fd_targets_after_warmup"], res["fd_targets_end"])) is not None:
            failures.append(f"process {res['rank']}: {leak}")
        # two stores per process (the threads' and the controller's), each with LOCK, journal and, per size
        # class (two here: K and V pages), a buffered and an O_DIRECT handle
        if res["store_fds_end"] > 12:
            failures.append(f"process {res['rank']}: {res['store_fds_end']} descriptors into the store directory")
    if full:
        full.stop()
        if full.episodes == 0:
            failures.append("--disk-full: the file system was never filled")
    summary = dict(date=time.strftime("%Y-%m-%d %H:%M:%S"), seconds=args.seconds, procs=args.procs, threads=args.threads,
                   disk_full_episodes=full.episodes if full else None,
                   store_write_failures=sum(r.get("store_write_failures", 0) for r in results),
                   device=args.device, wall_s=round(time.time() - t0, 1), ops=sum(r["ops"] for r in results),
                   bytes_moved=sum(r["bytes_moved"] for r in results), divergences=len(failures), failures=failures,
                   processes=results)
    print(f"soak: {summary['ops']} operations, {summary['bytes_moved'] / 1e6:.1f} MB moved, {args.procs} processes x "
          f"{args.threads} threads, {summary['wall_s']} s"
          + (f", {full.episodes} disk-full episodes ({summary['store_write_failures']} failed writes)" if full else "")
          + f": {len(failures)} failures")
    for f in failures[:20]:
        print("  FAIL", f)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    if full:
        full.unmount()
    if args.root is None:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return 1 if failures or len(results) != args.procs else 0


if __name__ == "__main__":
    sys.exit(main())
