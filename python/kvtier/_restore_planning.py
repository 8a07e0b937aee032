"""The restore-planning part of :class:`kvtier.TierController`, a component it owns (:class:`RestorePlanning`):
what every tier measured about itself, the plan for a request's cached prefix (:func:`kvtier.planner.plan_restore`),
the store reads and lookups that plan leads to, and what the engine reports back (its forwards' times for the
prefill model, each planned request's time to first token)."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from ._errors import InvalidArgumentError
from ._parts import Owner, Part
from .deadlines import TierIO, check_deadline
from .host_pages import page_slots
from .planner import PlannerStats, PrefillModel, RestorePlan, TierEstimate, TierMeter, plan_restore
from .pools import device_of

#: ``restore_deadline="auto"``: this many times the prefill model's time to recompute the pages, plus
#: AUTO_SLACK_S, within [AUTO_FLOOR_S, AUTO_CAP_S]; AUTO_UNKNOWN_S while the model has no fit
AUTO_FACTOR, AUTO_SLACK_S, AUTO_FLOOR_S, AUTO_UNKNOWN_S = 1.5, 0.05, 0.5, 2.0
AUTO_CAP_S = 10.0  # and at most this

T = TypeVar("T")


def prefill_model(prefill: PrefillModel | float | None) -> PrefillModel | None:
    """The ``prefill`` argument of :class:`kvtier.TierController` checked: a model, a fixed one for a number of
    tokens/s, or None (a learned one)."""
    if isinstance(prefill, (int, float)) and not isinstance(prefill, bool):
        return PrefillModel.fixed(prefill, name="prefill")
    if prefill is not None and not isinstance(prefill, PrefillModel):
        raise InvalidArgumentError(f"invalid argument `prefill`: a PrefillModel or tokens/s, got {prefill!r}")
    return prefill


class RestorePlanning:
    """Owned by a :class:`kvtier.TierController` (its ``planning``). Owns the prefill model (``prefill``), the
    planner's counters (``planner_stats``), the host tier's meter (``host_meter``), the restore and lookup
    deadlines, and the fences of store reads past their deadline (private host pages such a read may still
    write). Reaches the controller's store and counters through ``owner`` (an :class:`kvtier._parts.Owner`), its
    host index through ``usable_run`` (the leading run of keys on the host and usable, its pending backups
    polled) and its background work through ``track``; ``lock`` is the controller's, which guards the fences
    too."""

    def __init__(self, owner: Owner, *, host_pool: Any, device_pool: Any, page_tokens: int, page_bytes: int,
                 prefetch_budget: int, lock: threading.RLock, tier_io: TierIO,
                 usable_run: Callable[[list[str]], int], track: Callable[[concurrent.futures.Future[Any]], None],
                 prefill: PrefillModel | None, restore_deadline: float | str | None,
                 lookup_deadline_s: float | None) -> None:
        self.owner, self.host, self.device_pool = owner, host_pool, device_pool
        self.ps, self.page_bytes, self.prefetch_budget = page_tokens, page_bytes, prefetch_budget
        self.lock, self.tier_io, self.usable_run, self.track = lock, tier_io, usable_run, track
        #: how long a store read may take (``"auto"``, seconds or None) and a lookup (seconds or None)
        self.restore_deadline, self.lookup_deadline_s = restore_deadline, lookup_deadline_s
        #: the engine's prefill cost (learned from observe_prefill unless given) and every decision counted
        self.prefill = prefill if prefill is not None else PrefillModel()
        self.planner_stats = PlannerStats()
        #: the host tier's estimate of itself: host -> device copies (probed once; CPU loads observed)
        self.host_meter = TierMeter("host")
        self._fenced: set[int] = set()  # private page starts a read past its deadline may still write
        self._free_after: set[int] = set()  # fenced starts given back meanwhile: freed when their read returns

    def _slots(self, starts: Sequence[int]) -> torch.Tensor:
        return page_slots(starts, self.ps)

    def host_run(self, keys: list[str]) -> int:
        """The leading run of ``keys`` on the host and usable, observed by the host tier's meter."""
        n = self.usable_run(keys)
        self.host_meter.observe_lookup(n, len(keys))
        return n

    def count_lookup(self, keys: list[str], n: int, m: int) -> None:
        stats = self.owner.stats
        stats.host_hit_pages += n
        stats.store_hit_pages += m
        stats.miss_pages += len(keys) - n - m

    def match(self, page_keys: Sequence[str]) -> tuple[int, int]:
        """See :meth:`kvtier.TierController.match`."""
        keys, store = list(page_keys), self.owner.store
        n = self.host_run(keys)
        m = 0
        if store is not None and n < len(keys):
            m = int(self.lookup(lambda: store.batch_exists(keys[n:]), 0))
        self.count_lookup(keys, n, m)
        return n, m

    def fenced_among(self, starts: Sequence[int]) -> set[int]:
        """Those of ``starts`` a read past its deadline may still write (lock held)."""
        return {int(s) for s in starts} & self._fenced

    def free_later(self, starts: Sequence[int]) -> list[int]:
        """Of private pages given back, those free now; the fenced ones are freed when their read returns (lock
        held)."""
        late = self.fenced_among(starts)
        self._free_after |= late
        return [int(s) for s in starts if int(s) not in late]

    def probe_host(self) -> None:
        """Times a copy of up to 16 MiB of the host pool's memory to the device (the second of two), the
        host tier's seed figure. Reads host memory only; a probe that cannot run seeds nothing."""
        try:
            buf = getattr(self.host, "k_buffer", None)
            if buf is None:
                buf = self.host.kv_buffer
            src = buf.reshape(-1).view(torch.uint8)[: 16 << 20]
            dev = device_of(self.device_pool)
            dst = torch.empty(src.numel(), dtype=torch.uint8, device=dev)
            for _ in range(2):
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                dst.copy_(src, non_blocking=True)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                dt = time.perf_counter() - t0
            del dst
        except Exception:  # noqa: BLE001 - a probe never fails construction
            return
        if dt > 0:
            self.host_meter.seed(read_GBps=src.numel() / dt / 1e9)

    # ------------------------------------------------------------------ restore planning
    def lookup(self, fn: Any, missing: Any) -> Any:
        """A store lookup within ``lookup_deadline_s``: its answer, or ``missing`` (past the deadline, failed,
        or the store out of use); on this thread when the store's lookups never wait on IO."""
        if not getattr(self.owner.store, "lookups_may_block", True):
            return self.tier_io.run_inline("lookup", fn, missing)
        out = self.tier_io.run("lookup", fn, deadline_s=self.lookup_deadline_s, pages=0,
                               on_done=lambda r, late: missing if late or isinstance(r, BaseException) else r,
                               on_give_up=lambda started: missing)
        return out.result()

    def restore_deadline_s(self, tokens: int, *, plan: Any = None) -> float | None:
        """The deadline of a store read of ``tokens`` tokens' pages (see ``restore_deadline``); with ``plan`` (a
        :class:`kvtier.planner.RestorePlan`), from its time to recompute the whole prompt."""
        if not isinstance(self.restore_deadline, str):  # seconds, or None (no deadline)
            return self.restore_deadline
        s = plan.recompute_s if plan is not None else self.prefill.seconds(int(tokens), 0)
        if s is None:
            return AUTO_UNKNOWN_S
        return min(AUTO_CAP_S, max(AUTO_FLOOR_S, AUTO_FACTOR * float(s) + AUTO_SLACK_S))

    def deadline_stats(self) -> dict[str, Any]:
        """The store's calls by kind, deadline misses, calls skipped while it was out of use, fenced pages and the
        breaker's state (:class:`kvtier.deadlines.DeadlineStats`)."""
        b = self.tier_io.breaker
        return {**self.tier_io.stats.as_dict(), "breaker": b.state, "breaker_trips": b.trips,
                "breaker_recoveries": b.recoveries}

    def measured(self) -> dict[str, TierEstimate]:
        """What every tier measured about itself: ``host`` (host → device copies) and the store's tiers
        (``disk``, ``mooncake``, ...), each a :class:`kvtier.planner.TierEstimate`."""
        out = {"host": self.host_meter.estimate()}
        own = getattr(self.owner.store, "measured", None)
        if own is not None:
            out.update(own())
        return out

    @property
    def durable_tier(self) -> str | None:
        """The name of the store's durable tier (a :class:`kvtier.PageStore`'s, or a tier chain's first), whose
        copy of a page makes writing it again unnecessary; None without a store."""
        store = self.owner.store
        return getattr(store, "name", None) if store is not None else None

    def plan_restore(self, page_keys: Sequence[str], prompt_tokens: int, *, can_split: bool = True,
                     overlap: bool = False, trail: bool = False) -> RestorePlan:
        """How to restore the prefix of a prompt of ``prompt_tokens`` tokens whose full pages have the keys
        ``page_keys`` (:func:`kvtier.page_hashes`): which leading pages to take from the host, which to
        recompute, which to load from each store tier, and the predicted time to first token — the fastest
        plan by the tiers' measurements and the prefill model, never one predicted slower than recomputing
        everything (:func:`kvtier.planner.plan_restore`). Counted in :attr:`planner_stats`.

        Carrying a plan out: pages ``[0, host_pages)`` are on the host (:meth:`acquire` or :meth:`load`);
        with ``can_split``, start :meth:`prefetch` of ``page_keys[recompute_to:load_to]`` (it reads in the
        background), compute the head ``[host_pages, recompute_to)`` meanwhile, wait for the prefetch, then
        use pages ``[recompute_to, load_to)`` and compute the rest; report the forward times
        (:meth:`observe_prefill`) and the time to first token (:meth:`observe_ttft`). ``overlap``: the engine
        queues the rest's forward before the read has finished, ``trail``: and that forward follows the head layer
        by layer (see :func:`kvtier.planner.plan_restore`)."""
        if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens <= 0:
            raise InvalidArgumentError(f"invalid argument `prompt_tokens`: must be a positive int, got {prompt_tokens!r}")
        keys = list(page_keys)
        if len(keys) * self.ps > prompt_tokens:
            raise InvalidArgumentError(f"invalid argument `page_keys`: {len(keys)} pages of {self.ps} tokens are more than "
                                       f"the prompt's {prompt_tokens} tokens")
        keys = keys[: (prompt_tokens - 1) // self.ps]  # the last token is always computed
        n = self.host_run(keys)
        segments: list[tuple[str, int]] = []
        store = self.owner.store
        if store is not None and n < len(keys):
            locate = getattr(store, "locate", None)
            if locate is not None:
                segments = list(self.lookup(lambda: list(locate(keys[n:])), []))
            else:
                m = int(self.lookup(lambda: store.batch_exists(keys[n:]), 0))
                segments = [("store", m)] if m else []
        self.count_lookup(keys, n, sum(p for _, p in segments))
        # one prefetch brings in at most the budget: pages past it are not loadable by this restore
        segments = _cap(segments, self.prefetch_budget)
        plan = plan_restore(prompt_tokens=prompt_tokens, page_tokens=self.ps, page_bytes=self.page_bytes, host_pages=n,
                            store_segments=segments, tiers=self.measured(), prefill=self.prefill, can_split=can_split,
                            overlap=overlap, trail=trail)
        self.planner_stats.record(plan)
        return plan

    def read_into(self, page_keys: Sequence[str], starts: Sequence[int], *, first_layers: int = 0,
                  gate: Any = None, deadline: float | None = None) -> concurrent.futures.Future[int]:
        """Read the pages of ``page_keys`` from the store into the caller's private host pages ``starts`` (from
        :meth:`allocate`), in the background, in one batch: a split restore's tail, loaded while its head is
        computed. The future's result is how many leading pages were read and verified; the bytes of any page
        after them are not the page's (whatever the failed read left). The pages stay the caller's: hand the
        verified ones to the index with :meth:`adopt` (``stored=True``) or give them back with :meth:`free`,
        either only once the future is done.

        ``first_layers`` (with ``gate``, a ``kvtier._native.HostGate``): a store that can
        (:meth:`kvtier.PageStore.batch_get_layers_first`) reads those layers of every page first and opens the
        gate then, while it reads the rest; the gate opens by the end of the read whatever happens (every page
        is checked whole before the future's result counts it).

        ``deadline``: seconds (default: :meth:`restore_deadline_s` of these pages); past it the future answers 0
        (no page verified) and the gate opens, while the read, still running, keeps ``starts`` fenced: given
        back with :meth:`free` meanwhile, they are freed only once it returns; :meth:`adopt` refuses them."""
        keys, starts, store = list(page_keys), [int(s) for s in starts], self.owner.store
        split = getattr(store, "batch_get_layers_first", None) if first_layers else None
        if len(keys) != len(starts):
            raise InvalidArgumentError(f"invalid argument `starts`: {len(starts)} pages for {len(keys)} keys")
        if store is None and keys:
            raise InvalidArgumentError("invalid argument `page_keys`: this controller has no store to read from")
        deadline = check_deadline("deadline", deadline)
        if deadline is None:
            deadline = self.restore_deadline_s(len(keys) * self.ps)

        def work() -> list[bool]:
            if not keys:
                return []
            if split is not None:
                return list(split(keys, self._slots(starts), self.host.layer_num, first_layers, gate))
            return list(store.batch_get_v1(keys, self._slots(starts)))

        def give_up(started: bool) -> int:
            if started:
                with self.lock:
                    self._fenced.update(starts)
            if gate is not None:
                gate.open()
            return 0

        def done(result: Any, late: bool) -> int:
            # an IO failure is a miss, never an engine crash
            ok = [False] * len(keys) if isinstance(result, BaseException) else [bool(g) for g in result]
            if gate is not None:
                gate.open()
            with self.lock:
                self.count_reads(ok)
                if late:  # the pages are the caller's again; those it gave back meanwhile are freed now
                    self._fenced.difference_update(starts)
                    back = [s for s in starts if s in self._free_after]
                    self._free_after.difference_update(back)
                    if back:
                        self.host.free(self._slots(back))
            return next((i for i, g in enumerate(ok) if not g), len(ok))

        fut = self.tier_io.run("read", work, deadline_s=deadline, pages=len(keys), on_done=done, on_give_up=give_up,
                               reached=bool)
        self.track(fut)
        return fut

    def count_reads(self, ok: Sequence[bool]) -> None:
        """A store read's pages, read and missed, in the controller's counters (lock held)."""
        stats = self.owner.stats
        stats.prefetched_pages += sum(ok)
        stats.prefetch_misses += len(ok) - sum(ok)
        stats.bytes_from_store += sum(ok) * self.page_bytes

    def observe_prefill(self, new_tokens: int, context_tokens: int, seconds: float) -> None:
        """One forward of the engine: ``new_tokens`` computed after ``context_tokens`` cached ones took
        ``seconds`` (what the learned prefill model fits)."""
        self.prefill.observe(new_tokens, context_tokens, seconds)

    def observe_ttft(self, plan: RestorePlan, seconds: float) -> None:
        """The time to first token measured for a request restored by ``plan`` (predicted against observed)."""
        self.planner_stats.observe(plan, seconds)


class Planning(Part[T]):
    """A :class:`kvtier.TierController` attribute or method that is its ``planning`` component's."""

    def __init__(self, doc: str | None = None) -> None:
        super().__init__("planning", RestorePlanning, doc)


def _cap(segments: list[tuple[str, int]], pages: int) -> list[tuple[str, int]]:
    """The first ``pages`` pages of ``segments``."""
    out = []
    for name, n in segments:
        if pages <= 0:
            break
        out.append((name, min(n, pages)))
        pages -= n
    return out
