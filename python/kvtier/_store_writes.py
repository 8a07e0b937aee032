"""The store-writing part of :class:`kvtier.TierController`, a component it owns (:class:`StoreWrites`):
write-through writes in the background and write-back spills on the caller's thread, each within its deadline
(:mod:`kvtier.deadlines`)."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ._parts import Owner, Part
from .deadlines import TierIO
from .host_pages import HostPage, page_slots

T = TypeVar("T")


class StoreWrites:
    """Owned by a :class:`kvtier.TierController` (its ``writes``). Owns the write deadline (``write_deadline_s``).
    Reaches the controller's store and counters through ``owner`` (an :class:`kvtier._parts.Owner`), its host
    index through ``pages`` (guarded by ``lock``, which the caller of :meth:`spill` holds) and ``poll_locked`` (its
    pending backups seen complete, erased pages freed), a spill's deadline through ``spill_deadline`` (the
    controller's lookup deadline) and its background work through ``track``."""

    def __init__(self, owner: Owner, *, pages: dict[str, HostPage], lock: threading.RLock, tier_io: TierIO,
                 page_tokens: int, page_bytes: int, poll_locked: Callable[[], None],
                 track: Callable[[concurrent.futures.Future[Any]], None], spill_deadline: Callable[[], float | None],
                 write_deadline_s: float | None) -> None:
        self.owner, self.pages, self.lock, self.tier_io = owner, pages, lock, tier_io
        self.ps, self.page_bytes, self.poll_locked, self.track = page_tokens, page_bytes, poll_locked, track
        self.spill_deadline = spill_deadline
        #: how long a store write may hold its host pages before it is given up on (seconds or None)
        self.write_deadline_s = write_deadline_s

    def spill(self, key: str, start: int) -> list[bool] | None:
        """A write-back spill on the caller's thread (lock held), given the spill deadline: what it wrote, or
        None when it is past its deadline and still running."""

        def done(result: Any, late: bool) -> Any:
            if not late:
                return [False] if isinstance(result, BaseException) else list(result)
            with self.lock:  # the page it held can go now
                pg = self.pages.get(key)
                if pg is not None and pg.start == start:
                    pg.refs -= 1
                self.poll_locked()
            return None

        out = self.tier_io.run("write", lambda: self._store_write([key], [start]), deadline_s=None, pages=1,
                               on_done=done, on_give_up=lambda started: None if started else [False])
        try:
            return out.result(timeout=self.spill_deadline())
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
            ok: list[bool] = self.owner.store.batch_set_v1(keys, page_slots(starts, self.ps))
        except Exception:  # an IO failure is a miss later, never an engine crash
            ok = [False] * len(keys)
        stats = self.owner.stats
        stats.store_writes += sum(ok)
        stats.store_write_failures += len(ok) - sum(ok)
        stats.bytes_to_store += sum(ok) * self.page_bytes
        return ok

    def write_async(self, keys: list[str], events: list[Any]) -> None:
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
                    self.owner.stats.store_writes_given_up += len(keys)
                    self._release_locked(keys)

        def done(result: Any, late: bool) -> None:
            ok = [False] * len(live) if isinstance(result, BaseException) else list(result)
            with self.lock:
                for (k, _), good in zip(live, ok):
                    pg = self.pages.get(k)
                    if pg is not None:
                        pg.in_store = pg.in_store or good
                self._release_locked(keys)

        self.track(self.tier_io.run("write", work, deadline_s=self.write_deadline_s, pages=len(keys),
                                     on_done=done, on_give_up=give_up, reached=write_reached))

    def _release_locked(self, keys: Sequence[str]) -> None:
        for k in keys:
            if k in self.pages:
                self.pages[k].refs -= 1
        self.poll_locked()


class Writes(Part[T]):
    """A :class:`kvtier.TierController` attribute that is its ``writes`` component's."""

    def __init__(self, doc: str | None = None) -> None:
        super().__init__("writes", StoreWrites, doc)


def write_reached(result: Any) -> bool:
    """Whether a batch call reached the tier: it raised, or it had pages to move."""
    return not isinstance(result, list) or len(result) > 0
