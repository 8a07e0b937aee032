"""``TieredStore``: page stores in order, fastest first, behind the one batch interface of
:class:`kvtier.PageStore` — what :class:`kvtier.TierController` and the SGLang backend take as their store.

Semantics (docs/CLUSTER.md has the fault table):

- ``batch_set_v1`` writes every tier in order, all while the caller still owns the host pages (a write that
  outlived the call could store bytes the engine has already reused under a valid checksum). A page is
  acknowledged (True) when the **first** tier — the durable local ``PageStore`` — has it: a later tier's
  acknowledgement (Mooncake's) is never taken as durability.
- ``batch_get_v1`` asks each tier in order for the pages the tiers before it missed; every tier verifies what
  it serves (checksums), so a False page's host bytes are never taken as data. Pages a later tier served are
  then written to the tiers before it (reads fill the faster tiers), again inside the call.
- ``batch_exists`` is the leading run of pages present in **some** tier (a page found only in a later tier
  still counts), computed tier by tier without assuming a tier holds a prefix.
- An exception from a tier counts as an error of that tier and a miss (or a failed write) for its pages; it
  never reaches the engine. Bad arguments are checked by the first tier before any IO and do raise.
- Pages a tier served unverified (a cluster tier's ``accept_unverified``) are not copied into faster tiers,
  neither by a read's fill nor by the engine writing them back (``batch_set_v1`` reports them False).
- ``delete`` removes from every tier; a later tier may refuse for a while (Mooncake keeps an object another
  node read within its lease), so the chain also remembers the keys it deleted (the last 65,536) and serves
  none of them from a later tier until they are stored again.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from .._errors import ClosedError, InvalidArgumentError
from ..metrics import MetricsSource, Scrape
from ..tenants import erase_tag
from ..transfer.indices import index_array
from ..planner import TierEstimate
from ..tenants import check_keys as _keys
from ..tier import Tier

#: Keys a chain remembers as deleted (oldest forgotten first), see the module docs.
DELETED_KEPT = 65536


class _TierCounters:
    __slots__ = ("hits", "misses", "fills", "writes", "write_failures", "errors", "bytes_in", "bytes_out",
                 "get_s", "set_s")

    def __init__(self) -> None:
        self.hits = self.misses = self.fills = self.writes = self.write_failures = self.errors = 0
        self.bytes_in = self.bytes_out = 0
        self.get_s = self.set_s = 0.0

    def as_dict(self) -> dict[str, Any]:
        d = {s: getattr(self, s) for s in self.__slots__}
        d["read_GBps"] = self.bytes_in / self.get_s / 1e9 if self.get_s else 0.0
        d["write_GBps"] = self.bytes_out / self.set_s / 1e9 if self.set_s else 0.0
        return d


class TieredStore:
    """Stores in order (see the module docs).

    Args:
        tiers: ``[(name, store), ...]``, fastest first; the first must be durable (a :class:`kvtier.PageStore`).
            Every store must already be registered with the same host pool.
        fill: write pages a later tier served into the tiers before it (default True).
    """

    def __init__(self, tiers: Sequence[tuple[str, Tier]], *, fill: bool = True) -> None:
        tiers = list(tiers)
        if not tiers:
            raise InvalidArgumentError("invalid argument `tiers`: at least one (name, store) pair is needed")
        names = [n for n, _ in tiers]
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"invalid argument `tiers`: duplicate tier names {names}")
        pool = tiers[0][1].pool
        if pool is None:
            raise InvalidArgumentError("invalid argument `tiers`: register the host pool with every tier first")
        for n, s in tiers[1:]:
            if s.pool is not pool:
                raise InvalidArgumentError(f"invalid argument `tiers`: tier {n!r} is registered with another host "
                                           "pool than the first tier")
        self.tiers = tiers
        self.fill = bool(fill)
        self.page_bytes = int(tiers[0][1].page_bytes)
        self._counters = {n: _TierCounters() for n in names}
        self._lock = threading.Lock()
        self._deleted: collections.OrderedDict[str, None] = collections.OrderedDict()  # see DELETED_KEPT

    @property
    def name(self) -> str:
        """The first (durable) tier's name: a page it holds needs no writing again."""
        return self.tiers[0][0]

    @property
    def pool(self) -> Any:
        return self.tiers[0][1].pool

    @property
    def first(self) -> Any:
        return self.tiers[0][1]

    @property
    def lookups_may_block(self) -> bool:
        """Whether a lookup may wait on IO (any tier's may; a tier that does not say is taken to)."""
        return any(getattr(t, "lookups_may_block", True) for _, t in self.tiers)

    def register_mem_pool_host(self, pool: Any) -> None:
        for _, s in self.tiers:
            s.register_mem_pool_host(pool)

    def _count(self, name: str, **kw: float) -> None:
        with self._lock:
            c = self._counters[name]
            for k, v in kw.items():
                setattr(c, k, getattr(c, k) + v)

    @staticmethod
    def _slots(host_indices: torch.Tensor, ps: int, pages: list[int]) -> torch.Tensor:
        if not pages:
            return host_indices[:0]
        sel = torch.tensor(pages, dtype=torch.int64)
        return host_indices.view(-1, ps)[sel].reshape(-1)

    def _check_slots(self, keys: list[str], host_indices: Any) -> int:
        """Checks ``host_indices`` as the first tier would (a 1-D int64 tensor, ``page_size`` slots per key)
        before the chain slices it per tier; returns the page size."""
        index_array("host_indices", host_indices)
        ps: int = self.pool.page_size
        if len(host_indices) != len(keys) * ps:
            raise InvalidArgumentError(
                f"invalid argument `host_indices`: {len(host_indices)} slots for {len(keys)} pages of {ps}")
        return ps

    def _unverified(self, keys: list[str]) -> set[str]:
        """Which of ``keys`` a later tier has served without verifying them."""
        out: set[str] = set()
        for _, tier in self.tiers[1:]:
            check = getattr(tier, "served_unverified", None)
            if check is not None:
                out |= check(keys)
        return out

    def batch_set_v1(self, keys: Sequence[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Every tier, in order, inside the call; True where the first (durable) tier has the page. A page a
        later tier served unverified is not written (False): the durable tier would vouch for its bytes."""
        keys = _keys(keys)
        name0, first = self.tiers[0]
        skip = self._unverified(keys)
        if skip:
            ps = self._check_slots(keys, host_indices)
            keep = [i for i, k in enumerate(keys) if k not in skip]
            res = self.batch_set_v1([keys[i] for i in keep], self._slots(host_indices, ps, keep)) if keep else []
            out = [False] * len(keys)
            for i, r in zip(keep, res):
                out[i] = r
            return out
        if self._deleted:
            with self._lock:
                for k in keys:
                    self._deleted.pop(k, None)
        t0 = time.perf_counter()
        ok: list[bool] = first.batch_set_v1(keys, host_indices)  # checks the arguments; raises on bad ones
        self._count(name0, writes=sum(ok), write_failures=len(ok) - sum(ok), bytes_out=sum(ok) * self.page_bytes,
                    set_s=time.perf_counter() - t0)
        for name, tier in self.tiers[1:]:
            self._set_on(name, tier, keys, host_indices)
        return ok

    def _set_on(self, name: str, tier: Any, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        t0 = time.perf_counter()
        try:
            res: list[bool] = tier.batch_set_v1(keys, host_indices)
        except Exception:
            self._count(name, errors=1, write_failures=len(keys))
            return [False] * len(keys)
        self._count(name, writes=sum(res), write_failures=len(res) - sum(res),
                    bytes_out=sum(res) * self.page_bytes, set_s=time.perf_counter() - t0)
        return res

    def batch_get_v1(self, keys: Sequence[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Each tier in order for what the tiers before it missed; then fills the faster tiers."""
        keys = _keys(keys)
        ps = self._check_slots(keys, host_indices)
        ok = [False] * len(keys)
        want = list(range(len(keys)))
        served_by: list[tuple[int, list[int]]] = []
        with self._lock:
            deleted = {k for k in keys if k in self._deleted}
        for ti, (name, tier) in enumerate(self.tiers):
            if ti == 1 and deleted:  # deleted here: not served from a tier that may not have let go yet
                want = [i for i in want if keys[i] not in deleted]
            if not want:
                break
            t0 = time.perf_counter()
            try:
                res = tier.batch_get_v1([keys[i] for i in want], self._slots(host_indices, ps, want))
            except (InvalidArgumentError, ClosedError):
                if ti == 0:  # the caller's mistake (checked by the first tier before any IO): raised
                    raise
                self._count(name, errors=1, misses=len(want))
                continue
            except Exception:
                self._count(name, errors=1, misses=len(want))
                continue
            got = [i for i, r in zip(want, res) if r]
            self._count(name, hits=len(got), misses=len(want) - len(got), bytes_in=len(got) * self.page_bytes,
                        get_s=time.perf_counter() - t0)
            for i in got:
                ok[i] = True
            if ti > 0 and got:
                # pages a tier served without verifying them (a cluster tier's accept_unverified) are never
                # copied into the tiers before it: a durable tier would give them a fresh, valid checksum
                unverified = getattr(tier, "served_unverified", None)
                skip = unverified([keys[i] for i in got]) if unverified is not None else set()
                fill = [i for i in got if keys[i] not in skip]
                if fill:
                    served_by.append((ti, fill))
            want = [i for i in want if not ok[i]]
        if self.fill:
            for ti, got in served_by:
                for name, tier in self.tiers[:ti]:
                    res = self._set_on(name, tier, [keys[i] for i in got], self._slots(host_indices, ps, got))
                    self._count(name, fills=sum(res))
        return ok

    def batch_exists(self, keys: Sequence[str], extra_info: Any = None) -> int:
        """The leading run of pages that some tier holds."""
        keys = _keys(keys)
        with self._lock:
            deleted = next((i for i, k in enumerate(keys) if k in self._deleted), len(keys))
        pos = 0
        while pos < len(keys):
            best = 0
            for ti, (name, tier) in enumerate(self.tiers):
                # a later tier answers only up to the first key deleted here (it may still hold that one)
                part = keys[pos:] if ti == 0 else keys[pos:max(pos, deleted)]
                if not part:
                    continue
                try:
                    best = max(best, int(tier.batch_exists(part)))
                except Exception:
                    self._count(name, errors=1)
                if best == len(keys) - pos:
                    break
            if best == 0:
                break
            pos += best
        return pos

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def locate(self, keys: Sequence[str]) -> list[tuple[str, int]]:
        """Which tier serves each page of the leading run that some tier holds, as runs ``[(tier name,
        pages), ...]`` in key order: each page from the first (fastest) tier that has it, as
        :meth:`batch_get_v1` reads it — page by page against the first tier (its lookups are local), by
        leading runs among the later ones. Its total is :meth:`batch_exists`."""
        keys = _keys(keys)
        with self._lock:
            deleted = next((i for i, k in enumerate(keys) if k in self._deleted), len(keys))
        out: list[tuple[str, int]] = []

        def run(ti: int, name: str, tier: Any, part: list[str]) -> int:
            if not part:
                return 0
            try:
                return int(tier.batch_exists(part))
            except Exception:
                self._count(name, errors=1)
                return 0

        def add(name: str, n: int) -> None:
            if out and out[-1][0] == name:
                out[-1] = (name, out[-1][1] + n)
            else:
                out.append((name, n))

        (name0, first), pos = self.tiers[0], 0
        while pos < len(keys):
            n = run(0, name0, first, keys[pos:])
            if n:
                add(name0, n)
                pos += n
                continue
            found = next(((name, n) for ti, (name, tier) in enumerate(self.tiers[1:], 1)
                          if (n := run(ti, name, tier, keys[pos:max(pos, deleted)]))), None)
            if found is None:
                break
            name, n = found
            end = pos + 1  # the first tier lacks keys[pos]; the later tier serves up to the next page it has
            while end < pos + n and not run(0, name0, first, [keys[end]]):
                end += 1
            add(name, end - pos)
            pos = end
        return out

    def measured(self) -> dict[str, TierEstimate]:
        """Each tier's own estimate of itself, by the chain's tier names (see :class:`kvtier.PageStore`)."""
        out: dict[str, TierEstimate] = {}
        for name, tier in self.tiers:
            own = getattr(tier, "measured", None)
            if own is not None:
                est = next(iter(own().values()))
                out[name] = dataclasses.replace(est, name=name)
        return out

    def delete(self, keys: Sequence[str]) -> int:
        """Delete from every tier; returns how many pages the first tier had."""
        keys = _keys(keys)
        n = int(self.tiers[0][1].delete(keys))
        with self._lock:
            for k in keys:
                self._deleted[k] = None
                self._deleted.move_to_end(k)
            while len(self._deleted) > DELETED_KEPT:
                self._deleted.popitem(last=False)
        for name, tier in self.tiers[1:]:
            try:
                tier.delete(keys)
            except Exception:
                self._count(name, errors=1)
        return n

    def erase_tenant(self, salt: str | None = None, *, tag: str | None = None) -> int:
        """Remove one tenant's pages from every tier that can (``erase_tenant``); returns the sum of what they
        report (pages for a disk tier, objects for the cluster tier). A tier without it is skipped."""
        t = erase_tag(salt, tag)
        n = 0
        for _, tier in self.tiers:
            erase = getattr(tier, "erase_tenant", None)
            if erase is not None:
                n += int(erase(tag=t))
        return n

    def clear(self) -> None:
        for _, tier in self.tiers:
            tier.clear()

    def get_stats(self) -> dict[str, Any]:
        """Per tier: the tier's own counters (``store``) and the chain's view of it (hits, misses, fills,
        writes, errors, bytes, GB/s)."""
        out: dict[str, Any] = {}
        for name, tier in self.tiers:
            try:
                own = tier.get_stats()
            except Exception as e:  # a tier that cannot report still shows the chain's counters
                own = {"error": str(e)}
            with self._lock:
                out[name] = {**self._counters[name].as_dict(), "store": own}
        return out

    def report_metrics(self, scrape: Scrape, name: str) -> list[MetricsSource]:
        """Its view of each tier (pages by event, errors, bytes: :mod:`kvtier.metrics`); each tier that reports
        metrics of its own (:class:`kvtier.metrics.MetricsSource`) is returned to add them."""
        scrape.chain(self.get_stats)
        return [tier for _, tier in self.tiers if isinstance(tier, MetricsSource)]

    def close(self) -> None:
        for _, tier in self.tiers:
            tier.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
