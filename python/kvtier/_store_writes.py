"""The store-writing half of :class:`kvtier.TierController` (a mixin): write-through writes in the background
and write-back spills on the caller's thread, each within its deadline (:mod:`kvtier.deadlines`)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any

import torch

from .deadlines import TierIO


class StoreWrites:
    """Mixed into :class:`kvtier.TierController`, whose store, lock, index and counters it uses."""

    store: Any
    lock: Any
    pages: Any
    stats: Any
    tier_io: TierIO
    lookup_deadline_s: float | None
    write_deadline_s: float | None
    page_bytes: int
    _pending: list[concurrent.futures.Future[Any]]

    def _slots(self, starts: Sequence[int]) -> torch.Tensor:
        raise NotImplementedError  # TierController's

    def _poll_locked(self) -> None:
        raise NotImplementedError  # TierController's

    def _track(self, fut: concurrent.futures.Future[Any]) -> None:
        raise NotImplementedError  # TierController's

    def _spill(self, key: str, start: int) -> list[bool] | None:
        """A write-back spill on the caller's thread (lock held), given ``lookup_deadline_s``: what it wrote, or
        None when it is past its deadline and still running."""

        def done(result: Any, late: bool) -> Any:
            if not late:
                return [False] if isinstance(result, BaseException) else list(result)
            with self.lock:  # the page it held can go now
                pg = self.pages.get(key)
                if pg is not None and pg.start == start:
                    pg.refs -= 1
                self._poll_locked()
            return None

        out = self.tier_io.run("write", lambda: self._store_write([key], [start]), deadline_s=None, pages=1,
                               on_done=done, on_give_up=lambda started: None if started else [False])
        try:
            return out.result(timeout=self.lookup_deadline_s)
        except concurrent.futures.TimeoutError:
            self.tier_io.abandon(out)
            return out.result()
        except BaseException:  # a Ctrl-C: a queued spill never runs, a running one keeps its page until it returns
            self.tier_io.abandon(out)
            if out.result() is None:
                self.pages[key].refs += 1
            raise

    def _store_write(self, keys: list[str], starts: list[int]) -> list[bool]:
        try:
            ok: list[bool] = self.store.batch_set_v1(keys, self._slots(starts))
        except Exception:  # an IO failure is a miss later, never an engine crash
            ok = [False] * len(keys)
        self.stats.store_writes += sum(ok)
        self.stats.store_write_failures += len(ok) - sum(ok)
        self.stats.bytes_to_store += sum(ok) * self.page_bytes
        return ok

    def _write_async(self, keys: list[str], events: list[Any]) -> None:
        """Background: wait for the backups, write the pages, release their references (a write past its
        deadline keeps them until it returns; one that never started gives them back at its deadline)."""
        live: list[tuple[str, int]] = []

        def work() -> Any:
            for ev in {id(e): e for e in events if e is not None}.values():
                ev.synchronize()
            with self.lock:
                live.extend((k, self.pages[k].start) for k in keys if k in self.pages)
            return self._store_write([k for k, _ in live], [s for _, s in live]) if live else []

        def give_up(started: bool) -> None:
            if not started:
                with self.lock:
                    self.stats.store_writes_given_up += len(keys)
                    self._release_locked(keys)

        def done(result: Any, late: bool) -> None:
            ok = [False] * len(live) if isinstance(result, BaseException) else list(result)
            with self.lock:
                for (k, _), good in zip(live, ok):
                    pg = self.pages.get(k)
                    if pg is not None:
                        pg.in_store = pg.in_store or good
                self._release_locked(keys)

        self._track(self.tier_io.run("write", work, deadline_s=self.write_deadline_s, pages=len(keys),
                                     on_done=done, on_give_up=give_up, reached=write_reached))

    def _release_locked(self, keys: Sequence[str]) -> None:
        for k in keys:
            if k in self.pages:
                self.pages[k].refs -= 1
        self._poll_locked()


def write_reached(result: Any) -> bool:
    """Whether a batch call reached the tier: it raised, or it had pages to move."""
    return not isinstance(result, list) or len(result) > 0
