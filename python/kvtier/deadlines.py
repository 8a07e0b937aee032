"""Deadlines for a tier's calls: a stalled tier never stalls the engine.

A disk that stops answering (a hung NFS mount, a dying SSD, a throttle to zero) or a cluster process stopped
mid-call blocks the thread that called it for as long as the IO takes, and no system call of that kind can be
taken back. So a tier's calls run on threads of their own (:class:`TierIO`): the caller waits for the call or
for its deadline, whichever comes first, and past the deadline it is answered as if the tier had missed. What
the abandoned call still holds (the host pages it reads into or writes from) stays *fenced* — never handed out
again, never read — until the call has provably returned; then it is reclaimed, and what a late read verified
may be kept. A call that had not started by its deadline never starts.

A tier that keeps missing deadlines is taken out of use by a :class:`Breaker` (no lookups, reads or writes are
sent to it: its pages are misses, the engine recomputes) and let back after a cool-down once one probing call
answers in time.

Thread model: one timer thread for the whole process (:class:`Timers`) resolves callers at their deadlines;
each :class:`TierIO` has one thread for lookups, ``read_workers`` for reads and one for writes (writes keep
their order), so a read is never queued behind a stalled write nor a lookup behind a stalled read.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ._errors import InvalidArgumentError

KINDS = ("lookup", "read", "write")


class Timers:
    """Callbacks run at given monotonic times on one thread (started on first use). A callback must not block
    for long: it delays the others."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._cancelled: set[int] = set()
        self._cv = threading.Condition()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def call_at(self, when: float, fn: Callable[[], None]) -> int:
        """Runs ``fn`` at ``time.monotonic() >= when``; returns a handle for :meth:`cancel`."""
        with self._cv:
            h = next(self._ids)
            heapq.heappush(self._heap, (when, h, fn))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="kvtier-deadlines", daemon=True)
                self._thread.start()
            if self._heap[0][1] == h:  # (a later deadline than the next one does not wake the thread)
                self._cv.notify()
            return h

    def cancel(self, handle: int) -> None:
        with self._cv:
            self._cancelled.add(handle)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cv.wait(None if not self._heap else max(0.0, self._heap[0][0] - time.monotonic()))
                _, h, fn = heapq.heappop(self._heap)
                if h in self._cancelled:
                    self._cancelled.discard(h)
                    continue
            try:
                fn()
            except Exception:  # noqa: BLE001 - one callback's failure never stops the others' deadlines
                pass


TIMERS = Timers()


class Breaker:
    """Takes a tier out of use after ``threshold`` deadline misses in a row, for ``cooldown_s``; then lets one
    probing call through: answered in time, the tier is back (closed); missed, it is out again for twice as
    long (at most ``max_cooldown_s``). Thread-safe."""

    def __init__(self, threshold: int = 2, cooldown_s: float = 2.0, max_cooldown_s: float = 60.0) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
            raise InvalidArgumentError(f"invalid argument `threshold`: must be an int >= 1, got {threshold!r}")
        for name, v in (("cooldown_s", cooldown_s), ("max_cooldown_s", max_cooldown_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v == float("inf"):
                raise InvalidArgumentError(f"invalid argument `{name}`: must be a positive finite number, got {v!r}")
        self.threshold, self.base_cooldown_s, self.max_cooldown_s = threshold, float(cooldown_s), float(max_cooldown_s)
        self._lock = threading.Lock()
        self._misses = 0
        self._open_until: float | None = None  # None: closed
        self._cooldown = self.base_cooldown_s
        self._probing = False
        self.trips = 0  # times it opened
        self.recoveries = 0  # times a probe closed it again

    @property
    def state(self) -> str:
        with self._lock:
            if self._open_until is None:
                return "closed"
            return "half_open" if self._probing or time.monotonic() >= self._open_until else "open"

    def allow(self) -> bool:
        """Whether a call may go to the tier now (when half-open, the one probe is this call)."""
        with self._lock:
            if self._open_until is None:
                return True
            if self._probing or time.monotonic() < self._open_until:
                return False
            self._probing = True
            return True

    def answered(self) -> None:
        """A call finished within its deadline."""
        with self._lock:
            self._misses = 0
            if self._open_until is not None and self._probing:
                self._open_until, self._probing, self._cooldown = None, False, self.base_cooldown_s
                self.recoveries += 1

    def missed(self) -> None:
        """A call missed its deadline."""
        with self._lock:
            self._misses += 1
            if self._open_until is not None:
                if self._probing:  # the probe missed: out again, for longer
                    self._probing = False
                    self._cooldown = min(self._cooldown * 2, self.max_cooldown_s)
                    self._open_until = time.monotonic() + self._cooldown
                return
            if self._misses >= self.threshold:
                self._open_until = time.monotonic() + self._cooldown
                self.trips += 1


@dataclass
class DeadlineStats:
    """What a :class:`TierIO` counted, by call kind (``lookup``, ``read``, ``write``)."""

    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    #: calls answered at their deadline instead of by the tier
    deadline_misses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    #: calls never sent because the breaker had the tier out of use
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    #: pages held by calls past their deadline whose IO has not returned (never handed out, never read)
    fenced_pages: int = 0
    #: pages fenced, and reclaimed once their call returned, since the start
    fenced_pages_total: int = 0
    reclaimed_pages_total: int = 0
    #: calls past their deadline still running (threads held by a stalled tier)
    stuck_calls: int = 0
    #: the longest a call past its deadline took to return, in seconds
    longest_late_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"calls": dict(self.calls), "deadline_misses": dict(self.deadline_misses), "skipped": dict(self.skipped),
                "fenced_pages": self.fenced_pages, "fenced_pages_total": self.fenced_pages_total,
                "reclaimed_pages_total": self.reclaimed_pages_total, "stuck_calls": self.stuck_calls,
                "longest_late_s": self.longest_late_s}


def check_deadline(name: str, value: Any, *, auto: bool = False) -> Any:
    """``value`` if it is a deadline (positive finite seconds, None for none, or ``"auto"`` where allowed);
    otherwise an :class:`InvalidArgumentError` naming ``name``."""
    if value is None or (auto and value == "auto"):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        also = ', "auto"' if auto else ""
        raise InvalidArgumentError(f"invalid argument `{name}`: seconds > 0 (finite){also} or None, got {value!r}")
    return float(value)


class TierIO:
    """Runs one tier's calls with deadlines (see the module docs). ``breaker``: the tier's (default: a
    :class:`Breaker` with its defaults)."""

    def __init__(self, *, breaker: Breaker | None = None, read_workers: int = 2, name: str = "tier") -> None:
        self.breaker = breaker if breaker is not None else Breaker()
        self.stats = DeadlineStats()
        self._lock = threading.Lock()
        self._pools = {
            "lookup": concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"kvtier-{name}-lookup"),
            "read": concurrent.futures.ThreadPoolExecutor(read_workers, thread_name_prefix=f"kvtier-{name}-read"),
            "write": concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"kvtier-{name}-write"),
        }
        self._closed = False
        self._expire: dict[int, Callable[[], None]] = {}  # id(answer) -> its expiry, while the call is undecided

    def abandon(self, answer: concurrent.futures.Future[Any]) -> None:
        """The call that ``answer`` is for misses its deadline now, on this thread (a caller that waited for it
        with a timeout of its own); nothing when it is already answered."""
        with self._lock:
            expire = self._expire.get(id(answer))
        if expire is not None:
            expire()

    def run_inline(self, kind: str, fn: Callable[[], Any], missing: Any) -> Any:
        """``fn()`` on this thread, for a call that never waits on IO (a lookup in memory): no deadline, but the
        breaker is honoured (``missing`` while the tier is out of use, or when ``fn`` raises)."""
        with self._lock:
            self.stats.calls[kind] += 1
        if self._closed or not self.breaker.allow():
            with self._lock:
                self.stats.skipped[kind] += 1
            return missing
        try:
            out = fn()
        except Exception:  # noqa: BLE001 - a tier's failure is the caller's miss
            out = missing
        self.breaker.answered()
        return out

    def run(self, kind: str, fn: Callable[[], Any], *, deadline_s: float | None, pages: int | Callable[[], int],
            on_done: Callable[[Any, bool], Any], on_give_up: Callable[[bool], Any]) -> concurrent.futures.Future[Any]:
        """Runs ``fn()`` (the tier call) on ``kind``'s threads; the returned future is answered by whichever
        comes first:

        - the call returns within ``deadline_s`` (seconds from now; None: no deadline): ``on_done(result,
          False)`` runs on the call's thread and its value is the answer (``result`` is what ``fn`` returned, or
          the exception it raised);
        - the deadline passes first, or the breaker has the tier out of use: ``on_give_up(started)`` runs (on
          the timer thread, or here) and its value is the answer. ``started`` False: ``fn`` never ran and never
          will. True: it is running; ``pages`` pages (a number, or a function asked then) are counted fenced
          until it returns, and then
          ``on_done(result, True)`` runs on its thread (always after ``on_give_up`` has returned).

        ``on_give_up`` must not wait for anything a caller holds while it waits for the answer."""
        if kind not in KINDS:
            raise InvalidArgumentError(f"invalid argument `kind`: one of {KINDS}, got {kind!r}")
        out: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            self.stats.calls[kind] += 1
        if self._closed or not self.breaker.allow():
            with self._lock:
                self.stats.skipped[kind] += 1
            _answer(out, on_give_up, False)
            return out
        state: dict[str, Any] = {"phase": "queued", "fenced": 0}  # queued -> running -> done, or -> given_up
        given_up = threading.Event()
        t_submit = time.monotonic()

        def expire() -> None:
            with self._lock:
                phase = state["phase"]
                if phase in ("done", "given_up"):
                    return
                state["phase"] = "given_up"
                self._expire.pop(id(out), None)
                self.stats.deadline_misses[kind] += 1
                if phase == "running":
                    n = state["fenced"] = pages() if callable(pages) else pages
                    self.stats.fenced_pages += n
                    self.stats.fenced_pages_total += n
                    self.stats.stuck_calls += 1
            self.breaker.missed()
            try:
                _answer(out, on_give_up, phase == "running")
            finally:
                given_up.set()

        with self._lock:
            self._expire[id(out)] = expire
        timer = TIMERS.call_at(t_submit + deadline_s, expire) if deadline_s is not None else None

        def call() -> None:
            with self._lock:
                if state["phase"] == "given_up":
                    return  # its deadline passed in the queue: it never runs
                state["phase"] = "running"
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - a tier's failure is the caller's miss
                result = e
            with self._lock:
                late = state["phase"] == "given_up"
                if not late:
                    state["phase"] = "done"
                    self._expire.pop(id(out), None)
            if timer is not None and not late:
                TIMERS.cancel(timer)
            if not late:
                self.breaker.answered()
                _answer(out, lambda: on_done(result, False))
                return
            given_up.wait()  # (on_give_up has run: what it fenced is there to reclaim)
            try:
                on_done(result, True)
            finally:
                with self._lock:
                    self.stats.fenced_pages -= state["fenced"]
                    self.stats.reclaimed_pages_total += state["fenced"]
                    self.stats.stuck_calls -= 1
                    self.stats.longest_late_s = max(self.stats.longest_late_s, time.monotonic() - t_submit)

        try:
            self._pools[kind].submit(call)
        except RuntimeError:  # shut down meanwhile: never sent
            if timer is not None:
                TIMERS.cancel(timer)
            with self._lock:
                state["phase"] = "given_up"
                self._expire.pop(id(out), None)
                self.stats.skipped[kind] += 1
            _answer(out, on_give_up, False)
        return out

    def close(self) -> None:
        """No more calls; waits for the running ones unless a stalled one is past its deadline (its thread is
        left to end when its IO does)."""
        self._closed = True
        with self._lock:
            stuck = self.stats.stuck_calls
        for pool in self._pools.values():
            pool.shutdown(wait=not stuck, cancel_futures=True)


def _answer(out: concurrent.futures.Future[Any], fn: Callable[..., Any], *args: Any) -> None:
    """``out`` answered with ``fn(*args)`` (or its exception), unless it already is."""
    try:
        value = fn(*args)
    except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the answer
        if not out.done():
            out.set_exception(e)
        if not isinstance(e, Exception):
            raise
        return
    if not out.done():
        out.set_result(value)
