"""The reference the replay bench checks kvtier against: an exact, pure-Python model of the same tiers.

Block-granular (one trace block is one page), with the policy kvtier's tiers follow, step by step as the
bench drives them (:mod:`kvtier.replay.tiers`):

1. lookup: the leading run of the request's blocks in the host tier, then the leading run of the rest in the
   store (no recency change: ``PageStore.batch_exists`` touches nothing);
2. the host run is pinned and touched, in order (``TierController.acquire``);
3. the store run is brought into the host (``TierController.prefetch``): blocks of it already on the host are
   touched; the others get host pages — least-recently-used unpinned host pages are evicted one at a time
   until enough are free, and if none is left the whole prefetch fails (what it evicted stays evicted) —
   then are read from the store, which touches them there, and are pinned (``acquire``);
4. every block of the request not on the host now gets a host page the same way, fewer (from the end) when
   the host cannot hold them all, and is written through to the store: blocks the store holds are touched
   first, then the new ones are inserted in order, the store evicting its least-recently-used pages — never
   one this write names — to make room (``PageStore.batch_set_v1``: K and V objects are evicted together,
   so a page is the unit);
5. the pins are released.

The cluster tier (Mooncake Store, :class:`ClusterLru`) keeps Mooncake's own policy instead of a plain LRU:
an existence query touches every page it finds (it grants a read lease), and memory is freed in batches by
the master's watermark rule, not one page per insert (the class docs give the rule and its source).

What the model does not have: bytes. A store's capacity in bytes holds a page count that moves with its
journal (kvtier.replay.tiers sizes each store so that its mean equals the model's page count, and
the bench prints the page counts both held).
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Hashable, Sequence


class LruTier:
    """A store tier: pages in recency order (oldest first), at most ``capacity`` (None: unlimited)."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.pages: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        self.evictions = 0
        self.reads = 0
        self.writes = 0
        self.most_held = 0

    def run(self, keys: Sequence[Hashable]) -> int:
        """Leading run of ``keys`` held (touches nothing)."""
        n = 0
        while n < len(keys) and keys[n] in self.pages:
            n += 1
        return n

    def read(self, keys: Sequence[Hashable]) -> None:
        for k in keys:
            self.pages.move_to_end(k)
        self.reads += len(keys)

    def write(self, keys: Sequence[Hashable]) -> list[Hashable]:
        """Writes a batch; returns the keys stored (a new key that finds no room fails alone)."""
        batch = set(keys)
        new = []
        for k in keys:
            if k in self.pages:
                self.pages.move_to_end(k)
            else:
                new.append(k)
        if self.capacity is not None:
            room = self.capacity - len(self.pages)
            if room < len(new):
                victims = list(itertools.islice((k for k in self.pages if k not in batch), len(new) - room))
                for k in victims:
                    del self.pages[k]
                self.evictions += len(victims)
                new = new[: self.capacity - len(self.pages)]
        for k in new:
            self.pages[k] = None
        self.writes += len(new)
        self.most_held = max(self.most_held, len(self.pages))
        return [k for k in keys if k in self.pages]


class ClusterLru(LruTier):
    """The Mooncake Store cluster tier as the replay drives it (``kvtier.tiers.MooncakeTier`` over a
    :class:`kvtier.tiers.local_cluster.LocalCluster` with a 1 ms lease), from Mooncake's master
    (``mooncake-store/src/master_service.cpp``: ``GrantReadLease``, ``EvictionThreadFunc``, ``BatchEvict``):

    - a page costs ``page_cost`` bytes of the cluster's ``memory`` (its K and V objects and kvtier's record);
    - an existence query (``batch_is_exist``: lookups, routing, and the check before a put) and a read grant
      a lease, ``now + ttl``; a put ends with ``max(lease, now)``: with a 1 ms lease the order of expiry is the
      order of last touch, so a touch is ``move_to_end`` here, for every page a query finds (not only the
      leading run);
    - a put allocates every new object at once (one that finds no room fails; then the master wants an
      eviction); its new objects are not evictable until the put ends. The eviction thread (every 10 ms)
      evicts when the allocated share passes ``high_watermark`` (or a put failed): ``target = max(ratio,
      used - high_watermark + ratio)`` of the evictable objects, those whose lease expired first. A put of
      a request's pages takes longer than the thread's sleep, so the model evicts inside the put: after the
      allocation, among the pages held before it.
    """

    OBJECTS_PER_PAGE = 3  # K, V and the integrity record

    def __init__(self, memory: int, page_cost: int, high_watermark: float = 0.9, ratio: float = 0.05) -> None:
        super().__init__(memory // page_cost)
        self.memory, self.page_cost, self.high, self.ratio = memory, page_cost, high_watermark, ratio
        self.put_failures = 0
        self.eviction_rounds = 0

    def run(self, keys: Sequence[Hashable]) -> int:
        """Leading run of ``keys`` held; every held key queried is touched (an existence query leases it)."""
        n = super().run(keys)
        for k in keys:
            if k in self.pages:
                self.pages.move_to_end(k)
        return n

    def _evict(self, placed: int, failed: bool) -> None:
        used = (len(self.pages) + placed) * self.page_cost / self.memory
        if used <= self.high and not failed:
            return
        target = max(self.ratio, used - self.high + self.ratio)
        objects = math.ceil(self.OBJECTS_PER_PAGE * len(self.pages) * target)
        victims = min(len(self.pages), -(-objects // self.OBJECTS_PER_PAGE))  # a page missing an object is gone
        for _ in range(victims):
            self.pages.popitem(last=False)
        self.evictions += victims
        self.eviction_rounds += 1

    def write(self, keys: Sequence[Hashable]) -> list[Hashable]:
        for k in keys:  # the existence query before the put
            if k in self.pages:
                self.pages.move_to_end(k)
        new = [k for k in dict.fromkeys(keys) if k not in self.pages]
        room = max(0, (self.memory - len(self.pages) * self.page_cost) // self.page_cost)
        placed, failed = new[:room], new[room:]
        self.put_failures += len(failed)
        self._evict(len(placed), bool(failed))
        for k in placed:
            self.pages[k] = None
        self.writes += len(placed)
        self.most_held = max(self.most_held, len(self.pages))
        return [k for k in keys if k in self.pages]


class ModelNode:
    """One node: a host tier of ``host_pages`` and a store tier (its own, or one shared by several nodes)."""

    def __init__(self, host_pages: int, store: LruTier) -> None:
        self.host_pages = host_pages
        self.host: collections.OrderedDict[Hashable, int] = collections.OrderedDict()  # key -> pins
        self.store = store
        self.evictions = 0

    def peek(self, keys: Sequence[Hashable]) -> int:
        """The prefix this node would find (host run, then store run), changing nothing (routing)."""
        n = 0
        while n < len(keys) and keys[n] in self.host:
            n += 1
        return n + self.store.run(keys[n:])

    def _alloc(self, count: int) -> bool:
        """Room for ``count`` host pages: evicts LRU unpinned pages one at a time; False when none is left."""
        while self.host_pages - len(self.host) < count:
            victim = next((k for k, pins in self.host.items() if pins == 0), None)
            if victim is None:
                return False
            del self.host[victim]
            self.evictions += 1
        return True

    def _pin(self, keys: Sequence[Hashable]) -> None:
        for k in keys:
            self.host[k] += 1
            self.host.move_to_end(k)

    def serve(self, keys: Sequence[Hashable]) -> tuple[int, int]:
        """One request: ``(host blocks, store blocks)`` of its prefix found, then the tiers updated."""
        n = 0
        while n < len(keys) and keys[n] in self.host:
            n += 1
        m = self.store.run(keys[n:])
        pinned = list(keys[:n])
        self._pin(pinned)
        if m:
            seg = keys[n : n + m]
            for k in seg:
                if k in self.host:
                    self.host.move_to_end(k)
            want = [k for k in seg if k not in self.host]
            if self._alloc(len(want)):
                for k in want:
                    self.host[k] = 0
                self.store.read(want)
                self._pin(want)
                pinned += want
        new = [k for k in dict.fromkeys(keys) if k not in self.host]
        while new and not self._alloc(len(new)):
            new = new[:-1]
        for k in new:
            self.host[k] = 1
        pinned += new
        if new:
            self.store.write(new)
        for k in pinned:
            if k in self.host and self.host[k] > 0:
                self.host[k] -= 1
        return n, m


def one_lru_pct(requests: Sequence[tuple[int, Sequence[Hashable]]], capacity: int | None) -> float:
    """Hit rate (% of input tokens) of one LRU cache of ``capacity`` blocks (None: unlimited) over
    ``(input_length, block ids)`` requests: the longest cached prefix hits, then every block of the request is
    touched or inserted in order — the single cache the paper's Figure 9 sweeps."""
    lru: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
    hit = total = 0
    for length, ids in requests:
        n = 0
        while n < len(ids) and ids[n] in lru:
            n += 1
        hit += min(n * 512, length)
        total += length
        for k in ids:
            if k in lru:
                lru.move_to_end(k)
            else:
                lru[k] = None
        if capacity is not None:
            while len(lru) > capacity:
                lru.popitem(last=False)
    return 100.0 * hit / total if total else 0.0
