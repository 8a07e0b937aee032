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

Thread model: one timer thread for the whole process (:class:`Timers`) hands each expiry to the thread of
the :class:`TierIO` it belongs to, which answers the caller (a tier whose callbacks wait on a lock delays only
its own deadlines); each :class:`TierIO` has one thread for lookups, ``read_workers`` for reads and one for
writes (writes keep their order), so a read is never queued behind a stalled write nor a lookup behind a stalled
read. Every one of these threads is a daemon: a process whose tier is stuck in a system call can still exit.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import queue
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
        self._live: set[int] = set()  # armed and not run nor cancelled
        self._cv = threading.Condition()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def call_at(self, when: float, fn: Callable[[], None]) -> int:
        """Runs ``fn`` at ``time.monotonic() >= when``; returns a handle for :meth:`cancel`."""
        with self._cv:
            h = next(self._ids)
            heapq.heappush(self._heap, (when, h, fn))
            self._live.add(h)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="kvtier-deadlines", daemon=True)
                self._thread.start()
            if self._heap[0][1] == h:  # (a later deadline than the next one does not wake the thread)
                self._cv.notify()
            return h

    def cancel(self, handle: int) -> None:
        with self._cv:
            self._live.discard(handle)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cv.wait(None if not self._heap else max(0.0, self._heap[0][0] - time.monotonic()))
                _, h, fn = heapq.heappop(self._heap)
                if h not in self._live:
                    continue  # cancelled
                self._live.discard(h)
            try:
                fn()
            except Exception:  # noqa: BLE001 - one callback's failure never stops the others' deadlines
                pass


TIMERS = Timers()


class _Workers:
    """``n`` daemon threads running submitted functions in order (a thread pool whose threads never hold the
    interpreter's exit: a function stuck in a system call is left behind)."""

    def __init__(self, n: int, name: str) -> None:
        self._q: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._closed = False
        for i in range(n):
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn: Callable[[], None]) -> None:
        if self._closed:
            raise RuntimeError("closed")
        self._q.put(fn)

    def _run(self) -> None:
        while (fn := self._q.get()) is not None:
            try:
                fn()
            except Exception:  # noqa: BLE001 - one call's failure never stops the others
                pass

    def close(self, n: int) -> None:
        """No more work; the ``n`` threads end once what is queued has run."""
        self._closed = True
        for _ in range(n):
            self._q.put(None)


class Breaker:
    """Takes a tier out of use after ``threshold`` deadline misses in a row of one kind of call (a lookup that
    answers does not hide reads that miss), for ``cooldown_s``; then lets one probing call of that kind through:
    answered in time (and having reached the tier), the tier is back (closed); missed, it is out again for
    twice as long (at most ``max_cooldown_s``). Meanwhile calls of other kinds go through. Thread-safe."""

    def __init__(self, threshold: int = 2, cooldown_s: float = 2.0, max_cooldown_s: float = 60.0) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
            raise InvalidArgumentError(f"invalid argument `threshold`: must be an int >= 1, got {threshold!r}")
        for name, v in (("cooldown_s", cooldown_s), ("max_cooldown_s", max_cooldown_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v == float("inf"):
                raise InvalidArgumentError(f"invalid argument `{name}`: must be a positive finite number, got {v!r}")
        self.threshold, self.base_cooldown_s, self.max_cooldown_s = threshold, float(cooldown_s), float(max_cooldown_s)
        self._lock = threading.Lock()
        self._misses = dict.fromkeys(KINDS, 0)
        self._open_until: float | None = None  # None: closed
        self._tripped = ""  # the kind whose misses opened it: its calls probe
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

    def allow(self, kind: str = "read") -> str | None:
        """Whether a call of ``kind`` may go to the tier now: ``"call"``, ``"probe"`` (the one probing call,
        when half-open: report it with ``probe=True``), or None. Half-open, calls of other kinds than the one
        that missed go through (the lookups that find the pages a probing read needs)."""
        with self._lock:
            if self._open_until is None:
                return "call"
            if time.monotonic() < self._open_until:
                return None
            if kind != self._tripped:
                return "call"
            if self._probing:
                return None
            self._probing = True
            return "probe"

    def answered(self, kind: str = "read", *, probe: bool = False) -> None:
        """A call finished within its deadline."""
        with self._lock:
            self._misses[kind] = 0
            if probe and self._open_until is not None:
                self._open_until, self._probing, self._cooldown = None, False, self.base_cooldown_s
                self._misses = dict.fromkeys(KINDS, 0)
                self.recoveries += 1

    def unused(self) -> None:
        """The probe never reached the tier (it had nothing to do): the next call of its kind probes."""
        with self._lock:
            self._probing = False

    def missed(self, kind: str = "read", *, probe: bool = False) -> None:
        """A call missed its deadline."""
        with self._lock:
            self._misses[kind] += 1
            if self._open_until is not None:
                if probe:  # the probe missed: out again, for longer
                    self._probing = False
                    self._cooldown = min(self._cooldown * 2, self.max_cooldown_s)
                    self._open_until = time.monotonic() + self._cooldown
                return
            if self._misses[kind] >= self.threshold:
                self._open_until, self._tripped = time.monotonic() + self._cooldown, kind
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
        self._sizes = {"lookup": 1, "read": read_workers, "write": 1, "expiry": 1}
        self._pools = {k: _Workers(n, f"kvtier-{name}-{k}") for k, n in self._sizes.items()}
        self._closed = False
        self._expire: dict[int, Callable[[], None]] = {}  # id(answer) -> its expiry, while the call is undecided
        self._missed_groups: list[object] = []  # the last groups a miss was counted for

    def abandon(self, answer: concurrent.futures.Future[Any]) -> None:
        """The call that ``answer`` is for misses its deadline now, on this thread (a caller that waited for it
        with a timeout of its own, or was interrupted); nothing when it is already answered."""
        with self._lock:
            expire = self._expire.get(id(answer))
        if expire is not None:
            expire()

    def _admit(self, kind: str) -> str | None:
        """A call of ``kind`` counted, and the breaker's answer (None: skipped, counted so)."""
        admit = None if self._closed else self.breaker.allow(kind)
        with self._lock:
            self.stats.calls[kind] += 1
            self.stats.skipped[kind] += admit is None
        return admit

    def run_inline(self, kind: str, fn: Callable[[], Any], missing: Any) -> Any:
        """``fn()`` on this thread, for a call that never waits on IO (a lookup in memory): no deadline, but the
        breaker is honoured (``missing`` while the tier is out of use, or when ``fn`` raises)."""
        admit = self._admit(kind)
        if admit is None:
            return missing
        try:
            out = fn()
        except Exception:  # noqa: BLE001 - a tier's failure is the caller's miss
            out = missing
        self.breaker.answered(kind, probe=admit == "probe")
        return out

    def run(self, kind: str, fn: Callable[[], Any], *, deadline_s: float | None, pages: int | Callable[[], int],
            on_done: Callable[[Any, bool], Any], on_give_up: Callable[[bool], Any],
            reached: Callable[[Any], bool] | None = None,
            cancel: threading.Event | None = None, group: object = None) -> concurrent.futures.Future[Any]:
        """Runs ``fn()`` (the tier call) on ``kind``'s threads; the returned future is answered by whichever
        comes first:

        - the call returns within ``deadline_s`` (seconds from now; None: no deadline): ``on_done(result,
          False)`` runs on the call's thread and its value is the answer (``result`` is what ``fn`` returned, or
          the exception it raised);
        - the deadline passes first (or :meth:`abandon`), or the breaker has the tier out of use:
          ``on_give_up(started)`` runs (on this tier's expiry thread, or here) and its value is the answer.
          ``started`` False: ``fn`` never ran and never will. True: it is running; ``pages`` pages (a number, or
          a function asked once ``on_give_up`` has returned) are counted fenced until it returns, and then
          ``on_done(result, True)`` runs on its thread (always after ``on_give_up`` has returned).

        ``reached(result)``: whether the call reached the tier (default: always); a probing call that did not
        (nothing to read) leaves the breaker half-open for the next one. ``cancel``: set as the deadline passes,
        before ``on_give_up`` runs (a call that has not begun its IO yet looks at it and never does). ``group``:
        the calls of one batch cut in pieces (any object they share): the breaker counts their misses as one."""
        if kind not in KINDS:
            raise InvalidArgumentError(f"invalid argument `kind`: one of {KINDS}, got {kind!r}")
        out: concurrent.futures.Future[Any] = concurrent.futures.Future()
        admit = self._admit(kind)
        if admit is None:
            _answer(out, on_give_up, False)
            return out
        probe = admit == "probe"
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
                    self.stats.stuck_calls += 1
            if cancel is not None:
                cancel.set()
            with self._lock:
                counted = group is not None and any(g is group for g in self._missed_groups)
                if group is not None and not counted:
                    self._missed_groups.append(group)
                    del self._missed_groups[:-8]
            if not counted or probe:
                self.breaker.missed(kind, probe=probe)
            try:
                _answer(out, on_give_up, phase == "running")
            finally:
                if phase == "running":  # (counted once the caller's side has settled what the call holds)
                    n = pages() if callable(pages) else pages
                    with self._lock:
                        state["fenced"] = n
                        self.stats.fenced_pages += n
                        self.stats.fenced_pages_total += n
                given_up.set()

        with self._lock:
            self._expire[id(out)] = expire
        expiry = self._pools["expiry"]
        timer = (TIMERS.call_at(t_submit + deadline_s, lambda: _submit(expiry, expire))
                 if deadline_s is not None else None)

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
                if reached is None or reached(result):
                    self.breaker.answered(kind, probe=probe)
                elif probe:
                    self.breaker.unused()
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
        except RuntimeError:  # closed meanwhile: never sent
            if timer is not None:
                TIMERS.cancel(timer)
            with self._lock:
                state["phase"] = "given_up"
                self._expire.pop(id(out), None)
                self.stats.skipped[kind] += 1
            if probe:
                self.breaker.unused()
            _answer(out, on_give_up, False)
        return out

    def close(self) -> None:
        """No more calls. Queued calls still run (their callers wait for them or their deadlines); threads held
        by a stalled call end when its IO does (they are daemons: they never hold the process's exit)."""
        self._closed = True
        for k, pool in self._pools.items():
            pool.close(self._sizes[k])


def _submit(workers: _Workers, fn: Callable[[], None]) -> None:
    try:
        workers.submit(fn)
    except RuntimeError:  # (closed: the expiry runs here)
        fn()


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
