"""``TierController``: the HiCache workflow for any engine — GPU pool, host pool and page store tied together.

Pages are identified by their keys (``kvtier.page_hashes``). The controller tracks which pages are in the
host pool, keeps reference counts so a page being backed up, loaded or written is never evicted, evicts
least-recently-used host pages when it needs room (spilling them to the store first under ``write_back``),
and writes finished host pages to the store in the background under ``write_through`` (or once a page has
been hit ``hit_threshold`` times under ``write_through_selective``).

Errors of any tier become misses for the pages concerned, never wrong data: a page whose backup or store
read failed is not in the host index, and a page whose store read is still in flight (or whose backup is
not issued yet) is in it but not usable, so neither is ever reported as loadable. A Ctrl-C in the middle
of a call leaves the index as it was before the call (what was enqueued is waited for first).

Deadlines: every store call has one (:mod:`kvtier.deadlines`; a read past it is a miss, its pages fenced until
it returns; a write not started by it never starts; a lookup past it finds nothing).

Threading: public methods may be called from any thread (one lock guards the state); store IO runs on the
store's threads (:class:`kvtier.deadlines.TierIO`; :meth:`wait_idle` waits for each call or its deadline).
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from typing import Any
from collections.abc import Callable, Sequence

import torch

from ._errors import InvalidArgumentError
from .deadlines import Breaker, TierIO, check_deadline
from .host_pages import Stats, HostPage, page_slots
from .tenants import erase_tag, tenant_of, tenant_tag
from .overlap import LayerLoad, LayerLoader, backup_async
from ._restore_planning import Planning, RestorePlanning, prefill_model
from ._store_writes import StoreWrites, Writes, write_reached
from .planner import PlannerStats, PrefillModel, RestorePlan, TierEstimate, TierMeter
from .pools import device_of
from .tier import Tier, check_registered

POLICIES = ("write_through", "write_back", "write_through_selective")


class TierController:
    """See the module docs. Owns ``planning`` (:class:`RestorePlanning`) and ``writes`` (:class:`StoreWrites`).

    Args:
        device_pool: the engine's device KV pool (kvtier or SGLang attribute names).
        host_pool: a kvtier host pool built for it.
        store: an optional :class:`kvtier.PageStore` already registered with ``host_pool`` (checked: a
            store registered with another pool, or with none, is refused).
        io_backend: ``"direct"`` or ``"kernel"`` for device↔host transfers.
        write_policy: ``"write_through"`` (default), ``"write_back"`` or ``"write_through_selective"``.
        hit_threshold: hits before a page is written under ``write_through_selective`` (default 2).
        prefetch_budget_pages: most pages one :meth:`prefetch` may bring in (default: half the host pool).
        prefill: the engine's prefill cost for :meth:`plan_restore` — a :class:`kvtier.planner.PrefillModel`
            (fixed by the caller, or learned from :meth:`observe_prefill`; default: learned), or a number:
            the engine's prefill tokens/s.
        probe: measure host → device copies once at construction (the host tier's seed figure).
        restore_deadline: how long a store read may take before the request gives up on it and recomputes:
            ``"auto"`` (default: 1.5× the prefill model's time to recompute the pages + 50 ms, 0.5-10 s; 2 s
            until the model has a fit), seconds, or None (wait as long as the IO takes).
        write_deadline_s: how long a store write may hold its host pages before it is given up on (default 2;
            None: no limit). A write-back spill, which runs on the caller's thread, gets ``lookup_deadline_s``.
        lookup_deadline_s: how long a store lookup (``batch_exists``, ``locate``) may take before it finds
            nothing (default 1; None: no limit).
        breaker: when the store is taken out of use after missed deadlines (default:
            :class:`kvtier.deadlines.Breaker`: 2 misses in a row, back after 2 s if a probe answers in time).
    """

    store: Any  # a Tier, or None

    def __init__(
        self,
        device_pool: Any,
        host_pool: Any,
        store: Tier | None = None,
        *,
        io_backend: str = "direct",
        write_policy: str = "write_through",
        hit_threshold: int = 2,
        prefetch_budget_pages: int | None = None,
        prefill: PrefillModel | float | None = None,
        probe: bool = True,
        restore_deadline: float | str | None = "auto",
        write_deadline_s: float | None = 2.0,
        lookup_deadline_s: float | None = 1.0,
        breaker: Breaker | None = None,
    ) -> None:
        if device_pool is None or host_pool is None:
            raise InvalidArgumentError("invalid argument `device_pool`/`host_pool`: both are required (got None)")
        prefill = prefill_model(prefill)
        restore_deadline = check_deadline("restore_deadline", restore_deadline, auto=True)
        write_deadline_s = check_deadline("write_deadline_s", write_deadline_s)
        lookup_deadline_s = check_deadline("lookup_deadline_s", lookup_deadline_s)
        if breaker is not None and not isinstance(breaker, Breaker):
            raise InvalidArgumentError(f"invalid argument `breaker`: a kvtier.deadlines.Breaker, got {breaker!r}")
        if write_policy not in POLICIES:
            raise InvalidArgumentError(f"invalid argument `write_policy`: {write_policy!r}; expected one of {POLICIES}")
        check_registered(store, host_pool)
        self.device_pool, self.host, self.store = device_pool, host_pool, store
        self.io_backend, self.write_policy, self.hit_threshold = io_backend, write_policy, hit_threshold
        self.ps = host_pool.page_size
        self.prefetch_budget = prefetch_budget_pages if prefetch_budget_pages is not None else host_pool.page_num // 2
        self.pages: collections.OrderedDict[str, HostPage] = collections.OrderedDict()  # LRU: oldest first
        self.lock = threading.RLock()
        self.stats = Stats()
        self.loader = LayerLoader(host_pool, device_pool, io_backend)
        self._io = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-release")
        self._pending: list[concurrent.futures.Future[Any]] = []
        self.tier_io = TierIO(breaker=breaker, name="store")  # the store's calls, with their deadlines and breaker
        self.page_bytes = host_pool.get_size_per_token() * self.ps
        self.planning = RestorePlanning(
            self, host_pool=host_pool, device_pool=device_pool, page_tokens=self.ps, page_bytes=self.page_bytes,
            prefetch_budget=self.prefetch_budget, lock=self.lock, tier_io=self.tier_io, usable_run=self._usable_run,
            track=self._track, prefill=prefill, restore_deadline=restore_deadline, lookup_deadline_s=lookup_deadline_s)
        self.writes = StoreWrites(self, pages=self.pages, lock=self.lock, tier_io=self.tier_io, page_tokens=self.ps,
                                  page_bytes=self.page_bytes, poll_locked=self._poll_locked, track=self._track,
                                  spill_deadline=lambda: self.lookup_deadline_s, write_deadline_s=write_deadline_s)
        if probe:
            self.planning.probe_host()

    prefill: Planning[PrefillModel] = Planning("The engine's prefill cost (:class:`kvtier.planner.PrefillModel`).")
    planner_stats: Planning[PlannerStats] = Planning("Every restore decision counted.")
    host_meter: Planning[TierMeter] = Planning("The host tier's estimate of itself: host -> device copies.")
    restore_deadline: Planning[float | str | None] = Planning("How long a store read may take: \"auto\", s or None.")
    lookup_deadline_s: Planning[float | None] = Planning("How long a store lookup (or write-back spill) may take.")
    durable_tier: Planning[str | None] = Planning()
    plan_restore: Planning[Callable[..., RestorePlan]] = Planning()
    read_into: Planning[Callable[..., concurrent.futures.Future[int]]] = Planning()
    restore_deadline_s: Planning[Callable[..., float | None]] = Planning()
    measured: Planning[Callable[[], dict[str, TierEstimate]]] = Planning()
    observe_prefill: Planning[Callable[[int, int, float], None]] = Planning()
    observe_ttft: Planning[Callable[[RestorePlan, float], None]] = Planning()
    deadline_stats: Planning[Callable[[], dict[str, Any]]] = Planning()
    write_deadline_s: Writes[float | None] = Writes("How long a store write may hold its host pages (s or None).")

    def _slots(self, starts: Sequence[int]) -> torch.Tensor:
        return page_slots(starts, self.ps)

    def _usable_run(self, keys: list[str]) -> int:  # the leading run of keys on the host and usable
        with self.lock:
            self._poll_locked()
            return next((i for i, k in enumerate(keys) if k not in self.pages or not self.pages[k].usable), len(keys))

    def _poll_locked(self) -> None:  # backups seen complete; erased pages nothing holds wiped and freed
        doomed = []
        for k, pg in self.pages.items():
            if pg.event is not None and pg.event.query():
                pg.event, pg.ready = None, True
                pg.refs -= 1
            if pg.erased and pg.refs == 0 and pg.ready:
                doomed.append(k)
        for k in doomed:
            self._evict_locked(k)

    def _alloc_pages(self, n: int) -> list[int] | None:
        """Host page starts for ``n`` pages, evicting LRU unreferenced pages as needed (lock held)."""
        while self.host.available_size() < n * self.ps:
            victim = next((k for k, p in self.pages.items() if p.refs == 0 and p.ready), None)
            if victim is None:
                return None
            self._evict_locked(victim)
        got = self.host.alloc(n * self.ps)
        return None if got is None else got[:: self.ps].tolist()

    def _evict_locked(self, key: str) -> bool:
        """Evicts ``key`` (False: a spill past its deadline still reads it; it stays, held, until that returns)."""
        pg = self.pages[key]
        if self.write_policy == "write_back" and self.store is not None and not pg.in_store:
            ok = self.writes.spill(key, pg.start)  # before the memory is reused
            if ok is None:
                pg.refs += 1  # the spill's: given back when it returns
                return False
            self.stats.spills += sum(ok)
            self.stats.spills_given_up += 1 - sum(ok)
        # out of the index only now: a Ctrl-C during the spill leaves the page indexed and its memory held
        del self.pages[key]
        if pg.erased and (wipe := getattr(self.host, "wipe", None)) is not None:
            wipe(self._slots([pg.start]))  # an erased tenant's page keeps none of its KV once freed
        self.host.free(self._slots([pg.start]))
        self.stats.host_evictions += not pg.erased  # (an erased tenant's page is erased, not evicted)
        return True

    # ------------------------------------------------------------------ the workflow
    def backup(self, device_indices: torch.Tensor, page_keys: Sequence[str], *, after: Any = None) -> Any:
        """Back pages up from the device (``page_size`` device slots per key): host pages are allocated,
        one device→host copy is issued after ``after`` (an event; default: the current stream), and
        completion is reported by the returned event (``None`` on CPU or when nothing was new). Pages already
        on the host are only touched. Pages that find no host room are skipped (a later miss)."""
        keys = list(page_keys)
        if len(device_indices) != len(keys) * self.ps:
            raise InvalidArgumentError(f"invalid argument `device_indices`: {len(device_indices)} slots for "
                                       f"{len(keys)} pages of {self.ps}")
        with self.lock:
            self._poll_locked()
            new = [i for i, k in enumerate(keys) if k not in self.pages]
            for k in keys:
                if k in self.pages:
                    self.pages.move_to_end(k)
            if not new:
                return None
            starts = self._alloc_pages(len(new))
            while starts is None and new:
                new = new[:-1]  # not enough room: back up what fits
                starts = self._alloc_pages(len(new)) if new else None
            if not new or starts is None:
                return None
            for i, s in zip(new, starts):
                self.pages[keys[i]] = HostPage(start=s, refs=1)
        dev = torch.cat([device_indices[i * self.ps : (i + 1) * self.ps] for i in new])
        try:
            ev = backup_async(self.host, self.device_pool, self._slots(starts), dev, self.io_backend, after=after)
        except BaseException:  # an error, or a Ctrl-C: the new pages leave the index, their memory is freed
            self._drain()  # ... once whatever was enqueued into it has run
            with self.lock:
                for i in new:
                    pg = self.pages.pop(keys[i], None)
                    if pg is not None:
                        self.host.free(self._slots([pg.start]))
            raise
        with self.lock:
            for i in new:
                pg = self.pages[keys[i]]
                if ev is None:
                    pg.ready, pg.refs = True, 0
                else:
                    pg.event = ev
            self.stats.backed_up_pages += len(new)
            self.stats.bytes_device_to_host += len(new) * self.page_bytes
            if self.store is not None and self.write_policy == "write_through":
                for i in new:
                    self.pages[keys[i]].refs += 1
                self.writes.write_async([keys[i] for i in new], [ev] * len(new))
        return ev

    def _drain(self) -> None:
        """Waits for everything enqueued on the device (an interrupted call may have left copies on side streams)."""
        dev = device_of(self.device_pool)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def match(self, page_keys: Sequence[str]) -> tuple[int, int]:
        """``(host_hits, store_hits)``: the leading run of keys on the host and usable (a page still being
        read from the store is not), then how many of the following keys are in the store (the store part of
        the prefix)."""
        return self.planning.match(page_keys)

    def prefetch(self, page_keys: Sequence[str], *, deadline: float | None = None) -> concurrent.futures.Future[int]:
        """Bring the pages of ``page_keys`` that are not on the host in from the store, in the background
        (at most the prefetch budget of pages per call); the pages already on the host are touched so making
        room never evicts them. The future's result is the number of ``page_keys`` now on the host, usable.
        ``deadline``: seconds (default: :meth:`restore_deadline_s`); past it the future answers with what is
        usable then, and the pages still being read stay unusable (fenced) until the read returns: then those
        it verified are kept."""
        keys = list(page_keys)
        deadline = check_deadline("deadline", deadline)
        if deadline is None:
            deadline = self.restore_deadline_s(len(keys) * self.ps)
        want: list[str] = []
        starts: list[int] = []
        gave_up = threading.Event()  # (a read that has not taken its pages by then never does)

        def usable(started: bool = False) -> int:
            with self.lock:
                return sum(1 for k in keys if k in self.pages and self.pages[k].usable)

        def work() -> Any:
            with self.lock:
                for k in keys:  # the part already on the host must not be evicted to make room for the rest
                    if k in self.pages:
                        self.pages.move_to_end(k)
                if gave_up.is_set():
                    return []
                asked = [k for k in keys if k not in self.pages][: self.prefetch_budget]
                got = self._alloc_pages(len(asked)) if asked else []
                if got is None:
                    return []
                want.extend(asked)
                starts.extend(got)
                for k, s in zip(want, starts):
                    self.pages[k] = HostPage(start=s, refs=1)
            return self.store.batch_get_v1(want, self._slots(starts)) if want else []

        def done(result: Any, late: bool) -> int:
            ok = [False] * len(want) if isinstance(result, BaseException) else [bool(g) for g in result]
            with self.lock:
                for k, good in zip(want, ok):
                    pg = self.pages[k]
                    pg.refs -= 1  # the read's own reference (nothing else can hold one: it was not usable)
                    if good:
                        pg.ready, pg.in_store = True, True
                    elif pg.erased:  # a failed read of a tenant erased meanwhile: what it wrote is wiped too
                        self._evict_locked(k)
                    else:  # a miss: never leave unverified bytes reachable
                        del self.pages[k]
                        self.host.free(self._slots([pg.start]))
                self._poll_locked()  # (a page read for a tenant erased meanwhile: wiped and freed)
                self.planning.count_reads(ok)
                return sum(1 for k in keys if k in self.pages and self.pages[k].usable)

        fut = self.tier_io.run("read", work, deadline_s=deadline, pages=lambda: len(want), on_done=done,
                               on_give_up=usable, reached=write_reached, cancel=gave_up)
        self._track(fut)
        return fut

    def load(self, page_keys: Sequence[str], device_indices: torch.Tensor) -> LayerLoad:
        """Load host pages into ``device_indices`` layer by layer (a :class:`kvtier.LayerLoad`). Every key
        must be on the host and usable (see :meth:`match`); the pages are pinned until the load completes."""
        keys = list(page_keys)
        with self.lock:
            self._poll_locked()
            missing = [k for k in keys if k not in self.pages or not self.pages[k].usable]
            if missing:
                raise InvalidArgumentError(f"invalid argument `page_keys`: {len(missing)} page(s) are not on the host "
                                           "(or still being read from the store: wait for the prefetch)")
            events = [self.pages[k].event for k in keys if self.pages[k].event is not None]
            for k in keys:
                pg = self.pages[k]
                pg.refs += 1
                pg.hits += 1
                self.pages.move_to_end(k)
            starts = [self.pages[k].start for k in keys]
            selective = [k for k in keys if self.write_policy == "write_through_selective" and self.store is not None
                         and not self.pages[k].in_store and self.pages[k].hits == self.hit_threshold]
        try:
            after = None
            if events:
                for ev in events:  # a page still being backed up: the load follows its backup
                    torch.cuda.current_stream().wait_event(ev)
                after = torch.cuda.current_stream().record_event()
            t0 = time.perf_counter()
            load = self.loader.load(self._slots(starts), device_indices, after=after)
            if not self.loader.cuda:  # a CPU load is done on return: its time is the host tier's
                self.planning.host_meter.observe("read", len(keys) * self.page_bytes, time.perf_counter() - t0)
        except BaseException:  # an error, or a Ctrl-C: the references go back once nothing reads the pages
            self._drain()
            with self.lock:
                for k in keys:
                    if k in self.pages:
                        self.pages[k].refs -= 1
                self._poll_locked()
            raise

        def release() -> None:
            load.synchronize()
            with self.lock:
                for k in keys:
                    if k in self.pages:
                        self.pages[k].refs -= 1
                self._poll_locked()

        if device_of(self.device_pool).type == "cuda":
            self._track(self._io.submit(release))
        else:
            release()
        with self.lock:
            self.stats.loaded_pages += len(keys)
            self.stats.bytes_host_to_device += len(keys) * self.page_bytes
            if selective:
                for k in selective:
                    self.pages[k].refs += 1
                self.writes.write_async(selective, [None] * len(selective))
        return load

    # ------------------------------------------------------------------ pages an engine fills itself
    def allocate(self, n: int) -> list[int] | None:
        """Host page starts for ``n`` private pages (not in the index: the caller fills them and frees them
        with :meth:`free`, or hands them over with :meth:`adopt`), evicting least-recently-used unreferenced
        pages as needed; ``None`` when there is no room."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidArgumentError(f"invalid argument `n`: must be an int >= 0, got {n!r}")
        with self.lock:
            self._poll_locked()
            return self._alloc_pages(n) if n else []

    def free(self, starts: Sequence[int]) -> None:
        """Give back private pages from :meth:`allocate` that were not adopted (one a read past its deadline may
        still write is freed when that read returns)."""
        if starts:
            with self.lock:
                if now := self.planning.free_later(starts):
                    self.host.free(self._slots(now))

    def adopt(self, page_keys: Sequence[str], starts: Sequence[int], *, event: Any = None,
              stored: Sequence[bool] | None = None) -> list[bool]:
        """Put private pages the caller has filled (every layer) into the index under ``page_keys``, without a
        copy; ``event``: a CUDA event after which their bytes are complete (None: complete now). The caller
        keeps one reference per adopted page (give it back with :meth:`release`). A key already in the index
        is not adopted (False): its page stays the caller's. Written to the store as :meth:`backup` does,
        except the pages ``stored`` marks True (the caller recomputed pages the store already holds: a
        split restore's head)."""
        keys = list(page_keys)
        if len(keys) != len(starts):
            raise InvalidArgumentError(f"invalid argument `starts`: {len(starts)} pages for {len(keys)} keys")
        if stored is not None and len(stored) != len(keys):
            raise InvalidArgumentError(f"invalid argument `stored`: {len(stored)} flags for {len(keys)} keys")
        held = {k for k, s in zip(keys, stored) if s} if stored is not None else set()
        with self.lock:
            if fenced := self.planning.fenced_among(starts):
                raise InvalidArgumentError(f"invalid argument `starts`: page(s) {sorted(fenced)} are still being "
                                           "written by a store read past its deadline")
            self._poll_locked()
            done = []
            for k, s in zip(keys, starts):
                if k in self.pages:
                    done.append(False)
                    continue
                self.pages[k] = HostPage(start=int(s), refs=1 if event is None else 2, ready=event is None, event=event,
                                          in_store=k in held)
                done.append(True)
            new = [k for k, ok in zip(keys, done) if ok]
            self.stats.backed_up_pages += len(new)
            new = [k for k in new if k not in held]
            if new and self.store is not None and self.write_policy == "write_through":
                for k in new:
                    self.pages[k].refs += 1
                self.writes.write_async(new, [event] * len(new))
        return done

    def acquire(self, page_keys: Sequence[str]) -> list[int]:
        """Host page starts of the leading run of ``page_keys`` in the index, each with one more reference (so
        it is neither evicted nor reused until :meth:`release`). A page whose backup is still in flight
        counts: the caller orders its reads after that backup (kvtier's transformers cache issues both on
        one stream); a page still being read from the store does not."""
        with self.lock:
            self._poll_locked()
            starts = []
            for k in page_keys:
                pg = self.pages.get(k)
                if pg is None or not pg.usable:  # absent, a store read in flight, or its tenant erased
                    break
                pg.refs += 1
                pg.hits += 1
                self.pages.move_to_end(k)
                starts.append(pg.start)
            return starts

    def release(self, page_keys: Sequence[str]) -> None:
        """Give back references taken by :meth:`acquire` or kept by :meth:`adopt`."""
        with self.lock:
            for k in page_keys:
                pg = self.pages.get(k)
                if pg is not None and pg.refs > 0:
                    pg.refs -= 1
                    if pg.erased and pg.refs == 0 and pg.ready:
                        self._evict_locked(k)  # the last hold of an erased tenant's page: wiped and freed now

    def erase_tenant(self, salt: str | None = None, *, tag: str | None = None) -> dict[str, int]:
        """Remove one tenant (named by ``salt`` or ``tag``; the store's deployment tenant is every page) from the
        store (its ``erase_tenant``, after the writes in flight), then from the host tier: ``{"host": pages wiped
        and freed, "host_in_use": pages held (never a hit or a store write again; wiped and freed when the last
        hold ends), "store": pages (or objects) the store removed}``."""
        t = erase_tag(salt, tag)
        dep = getattr(self.store, "tenant", None)  # a store's deployment tenant: every page here is that tenant's
        everyone = isinstance(dep, str) and tenant_tag(dep) == t
        self.wait_idle()
        erase = getattr(self.store, "erase_tenant", None)  # the store first: from then on it refuses the tenant
        stored = int(erase(tag=t)) if erase is not None else 0
        freed = in_use = 0
        with self.lock:
            self._poll_locked()
            for k in [k for k in self.pages if everyone or tenant_of(k) == t]:
                pg = self.pages[k]
                pg.in_store = pg.erased = True  # never spilled (write_back), never a hit, wiped when freed
                if pg.refs or not pg.ready:
                    in_use += 1
                    continue
                self._evict_locked(k)
                freed += 1
        return {"host": freed, "host_in_use": in_use, "store": stored}

    def evict_unreferenced(self) -> int:
        """Evict every host page no load or backup references any more (after its store write under
        ``write_back``): later restores of those pages come from the store. Returns the pages evicted."""
        with self.lock:
            self._poll_locked()
            victims = [k for k, p in self.pages.items() if p.refs == 0 and p.ready]
            return sum(self._evict_locked(k) for k in victims)

    def wait_idle(self) -> None:
        """Wait for every background store write, prefetch and release (one past its deadline: answered)."""
        while waiting := [f for f in list(self._pending) if not f.done()]:
            concurrent.futures.wait(waiting)  # (two threads may wait for the same ones)
        done = [f for f in list(self._pending) if f.done()]
        self._pending[:] = [f for f in self._pending if not f.done()]
        for f in done:
            f.result()

    def _track(self, fut: concurrent.futures.Future[Any]) -> None:  # (answered ones let go of as more come)
        self._pending.append(fut)
        if len(self._pending) > 256:
            self._pending[:] = [f for f in self._pending if not f.done()]

    def close(self) -> None:
        self.wait_idle()
        self._io.shutdown(wait=True)
        self.tier_io.close()
