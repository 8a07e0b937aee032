"""Deadlines for an engine's own host pool: page batches moved through staging pages of kvtier's memory.

kvtier's own controller reads into host pages it owns, so a read it stops waiting for can be fenced (see
:mod:`kvtier.deadlines`). SGLang's and vLLM's backends read into the *engine's* host pool, and an engine
hands a page whose read failed to another request at once: a read answered False at its deadline and landing
later would write into memory that is no longer its page. So with a deadline these batches move through
staging pages of the store's own (:class:`StagingPages`):

- a read goes into staging pages on a tier thread; each piece that returns in time is copied into the pool
  by the caller's thread, before the call returns, and never after; a piece past the deadline is False and
  its staging pages stay fenced (never reused) until its IO returns;
- a write's pages are copied out of the pool first, on the caller's thread, then written from staging on
  the tier's write thread; a piece that makes no progress for the write deadline is False (the engine keeps
  the page and may write it again) and its staging pages are fenced until its IO returns; what a late write
  stores is the bytes it was given, whole.

Batches are cut into pieces of at most a quarter of the staging pages (at least one page), so reads, copies
and writes overlap: a read into four pieces at least, a write into two (each written piece ends in a sync). A tier that keeps missing deadlines is taken out of use by the :class:`kvtier.deadlines.Breaker`
(its pages are misses, the engine recomputes) and let back after a probe answers in time. With no deadline
(``None``) the batches go to the engine's pool directly, zero copy, as before.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time
from typing import Any

import numpy as np
import torch

from ._errors import InvalidArgumentError
from .buffer import HostBuffer
from .deadlines import Breaker, TierIO, check_deadline
from .metrics import MetricsSource, Scrape
from .tenants import check_keys
from . import native_calls

#: Staging memory by default: a quarter of it per piece of a batch.
DEFAULT_STAGING_BYTES = 256 << 20
#: SGLang's default prefetch timeout (``PrefetchTimeoutConfig``): the read deadline "auto" of a batch.
AUTO_READ_BASE_S = 2.0
AUTO_READ_PER_KI_TOKEN_S = 0.1
AUTO_READ_MAX_S = 30.0
_GENERATIONS = itertools.count(1)


class StagingPages:
    """Staging memory of one geometry: ``pages`` pages, each its K object then its V object, each starting
    on a 4 KiB boundary (O_DIRECT straight into them). ``bind`` registers it with a native store."""

    def __init__(self, geometry: tuple, staging_bytes: int) -> None:
        k_len, v_len, page_tokens = int(geometry[2]), int(geometry[5]), int(geometry[6])
        k_room = -(-k_len // 4096) * 4096
        stride = k_room + -(-v_len // 4096) * 4096
        self.pages = max(1, int(staging_bytes) // stride)
        self.generation = next(_GENERATIONS)  # (new staging pages, a new generation: what old pieces check)
        self.buffer = HostBuffer(self.pages * stride, pin=False)
        p = self.buffer.ptr
        self.layout = (p, stride, k_len, p + k_room if v_len else p, stride, v_len, page_tokens, self.pages)

    def bind(self, native: Any) -> None:
        native.register_region(self.buffer.region)
        native.bind_staging(*self.layout)


class StagingPool:
    """An engine's host pool seen through staging pages: the pool's geometry (layout, page size, dtype, heads,
    layers: what names a page's objects and checks them), the staging pages' memory. A tier registered with it
    (the cluster tier under :class:`StagedIO`) reads into and writes from staging pages, never the engine's."""

    def __init__(self, pool: Any, staging: StagingPages) -> None:
        self._engine, self.staging = pool, staging
        self.buffers = (staging.buffer,)
        self.page_size = int(pool.page_size)
        self.page_num = staging.pages
        self.size = staging.pages * self.page_size

    def __getattr__(self, name: str) -> Any:
        if name in ("kv_buffer", "k_buffer", "v_buffer"):  # (memory is the staging pages', never the engine's)
            raise AttributeError(name)
        return getattr(self._engine, name)

    def get_page_buffer_meta(self, indices: Any) -> tuple[list[int], list[int]]:
        k_base, stride, k_len, v_base, _, v_len = self.staging.layout[:6]
        ptrs: list[int] = []
        sizes: list[int] = []
        for start in torch.as_tensor(indices)[:: self.page_size].tolist():
            p = int(start) // self.page_size
            ptrs.append(k_base + p * stride)
            sizes.append(k_len)
            if v_len:
                ptrs.append(v_base + p * stride)
                sizes.append(v_len)
        return ptrs, sizes


class StagedDisk:
    """A :class:`kvtier.PageStore` whose v1 batches name its staging pages (the first tier of a chain whose other
    tiers are registered with the same :class:`StagingPool`); everything else is the store's."""

    def __init__(self, store: Any, pool: StagingPool) -> None:
        self.store, self.pool = store, pool

    def batch_get_v1(self, keys: Any, host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        return self.store.batch_staged(False, keys, host_indices, self.pool.staging.generation)

    def batch_set_v1(self, keys: Any, host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        return self.store.batch_staged(True, keys, host_indices, self.pool.staging.generation)

    def report_metrics(self, scrape: Scrape, name: str) -> tuple[MetricsSource]:
        """Nothing of its own: the store reports its metrics (:mod:`kvtier.metrics`)."""
        return (self.store,)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def auto_read_deadline_s(pages: int, page_tokens: int, base_s: float = AUTO_READ_BASE_S,
                         per_ki_token_s: float = AUTO_READ_PER_KI_TOKEN_S) -> float:
    """The read deadline "auto" of a batch of ``pages`` pages: SGLang's prefetch timeout rule (``base_s`` + ``per_ki_token_s``
    per 1024 tokens, at most 30 s): no engine waits longer for these pages, so no read need run longer."""
    return min(AUTO_READ_MAX_S, base_s + per_ki_token_s * pages * page_tokens / 1024)


class _Piece:
    """One piece of a batch: its first key, its staging pages and who frees them. The tier's thread frees them
    when the IO returns late or failed (or was never started); a read answered in time is the caller's, who
    copies it into the pool and frees it, or, having walked away (Ctrl-C), frees it without a copy."""

    __slots__ = ("lo", "slots", "gen", "_free", "_lock", "_answered", "_abandoned", "_settled", "submitting", "fut")

    def __init__(self, lo: int, slots: list[int], gen: int, free: Any) -> None:
        self.lo, self.slots, self.gen, self._free = lo, slots, gen, free
        self._lock = threading.Lock()
        self._answered = self._abandoned = self._settled = False
        self.submitting = False  # set just before its IO is submitted
        self.fut: concurrent.futures.Future[Any] | None = None

    def give(self) -> None:
        """Frees the staging pages (once)."""
        with self._lock:
            if self._settled:
                return
            self._settled = True
        self._free(self.slots, self.gen)

    def answered(self) -> None:
        """The read returned in time (tier thread): the caller's now, or freed if the caller walked away."""
        with self._lock:
            self._answered = True
            orphan = self._abandoned
        if orphan:
            self.give()

    def abandon(self, io: TierIO) -> None:
        """The caller walks away (Ctrl-C): nothing of this piece is copied any more; its pages are freed now if
        its IO is done or was never sent, else when the IO returns (by its callbacks: a piece interrupted inside
        its submission included, whose future the caller never saw)."""
        with self._lock:
            self._abandoned = True
            mine = self._answered
        if mine or not self.submitting:
            self.give()
        elif self.fut is not None:
            io.abandon(self.fut)


class StagedIO:
    """A :class:`kvtier.PageStore`'s batches for an engine's host pool, with deadlines (see the module docs).

    ``read_deadline_s``: seconds for a whole read batch, ``"auto"`` (:func:`auto_read_deadline_s`, or the
    ``read_deadline`` a caller passes) or None (no deadline: zero copy, no staging); ``write_deadline_s``:
    seconds a written piece may take from its start (progress, not the batch: a slow disk is not a stalled
    one), or None. ``staging_bytes``: the staging memory (allocated on first use)."""

    def __init__(self, store: Any, *, read_deadline_s: Any = "auto", write_deadline_s: Any = 2.0,
                 staging_bytes: int = DEFAULT_STAGING_BYTES, breaker: Breaker | None = None,
                 name: str = "engine") -> None:
        self.read_deadline_s = check_deadline("read_deadline_s", read_deadline_s, auto=True)
        self.write_deadline_s = check_deadline("write_deadline_s", write_deadline_s)
        if isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int) or staging_bytes < 4096:
            raise InvalidArgumentError(f"invalid argument `staging_bytes`: an int >= 4096, got {staging_bytes!r}")
        self.store = store
        self.staging_bytes = staging_bytes
        self.io = TierIO(breaker=breaker, name=name)
        #: what moves a piece between staging pages and the tiers (``batch_get_v1``/``batch_set_v1`` on staging
        #: indices): None for the store alone; a chain over :class:`StagedDisk` and tiers registered with
        #: :meth:`staging_pool`
        self.staged_tier: Any = None
        self._tier_gen: int | None = None  # the staging generation `staged_tier` is registered with
        self._cv = threading.Condition()
        self._free: list[int] = []  # staging pages free, of generation `_gen`
        self._gen = 0
        self._total = 0  # staging pages of generation `_gen`
        #: pieces not sent because no staging page was free before the deadline
        self.staging_waits_given_up = 0

    @property
    def breaker(self) -> Breaker:
        return self.io.breaker

    def stats(self) -> dict[str, Any]:
        """The deadline counters (:class:`kvtier.deadlines.DeadlineStats`), the breaker's state and trips, and
        the staging pages (total, free)."""
        with self._cv:
            free, total = len(self._free), self._total
        return {**self.io.stats.as_dict(), "breaker": self.breaker.state, "breaker_trips": self.breaker.trips,
                "breaker_recoveries": self.breaker.recoveries, "staging_pages": total, "staging_free": free,
                "staging_waits_given_up": self.staging_waits_given_up}

    # ------------------------------------------------------------------ staging pages
    def prepare(self) -> None:
        """Allocates the staging pages for the store's registered pool now (else the first batch does), when a
        deadline is on."""
        if self.read_deadline_s is not None or self.write_deadline_s is not None:
            self._slots()

    def staging_pool(self) -> StagingPool:
        """The registered pool seen through the staging pages (for the tiers behind the store)."""
        return StagingPool(self.store.pool, self.store.stage(self.staging_bytes))

    def _slots(self) -> int:
        """The staging generation in use (made or renewed for the store's current pool)."""
        staging = self.store.stage(self.staging_bytes)
        pages, gen = staging.pages, staging.generation
        with self._cv:
            if gen != self._gen:  # a pool registered again: new staging pages (late IO keeps the old ones)
                self._gen, self._free, self._total = gen, list(range(pages)), pages
            return gen

    def _take(self, n: int, gen: int, lo: int, pieces: list[_Piece]) -> _Piece | None:
        """``n`` free staging pages as a piece at key ``lo`` (listed in ``pieces`` before this returns), or None."""
        with self._cv:
            if gen != self._gen or len(self._free) < n:
                return None
            piece = _Piece(lo, self._free[:n], gen, self._give)
            self._free = self._free[n:]
            pieces.append(piece)
            return piece

    def _give(self, slots: list[int], gen: int) -> None:
        with self._cv:
            if gen == self._gen:
                self._free.extend(slots)
                self._cv.notify_all()

    def _wait_free(self, n: int, gen: int, until: float) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: gen != self._gen or len(self._free) >= n,
                                     timeout=max(0.0, until - time.monotonic())) and gen == self._gen

    # ------------------------------------------------------------------ batches
    def _check(self, keys: list[str], host_indices: Any, distinct: bool) -> np.ndarray:
        """``host_indices`` as whole pages of the pool (``page_size`` consecutive slots from a multiple of it), one
        per key, distinct pages when ``distinct`` (a read's destinations), checked before anything moves. Numpy
        from here on (kvtier.native_calls says why)."""
        pool = self.store.pool
        ps, pages = int(pool.page_size), int(getattr(pool, "page_num", None) or pool.size // pool.page_size)
        if not isinstance(host_indices, torch.Tensor) or host_indices.dtype != torch.int64 or host_indices.dim() != 1:
            raise InvalidArgumentError("invalid argument `host_indices`: expected a 1-D torch.int64 tensor")
        idx = native_calls.indices(host_indices)
        if idx.size != len(keys) * ps:
            raise InvalidArgumentError(f"invalid argument `host_indices`: {idx.size} slots for {len(keys)} keys of "
                                       f"{ps}-token pages")
        if not idx.size:
            return idx
        grid = idx.reshape(-1, ps)
        starts = grid[:, 0]
        if int(starts.min()) < 0 or int(starts.max()) >= pages * ps or bool((starts % ps).any()):
            raise InvalidArgumentError(f"invalid argument `host_indices`: pages must start at multiples of {ps} in "
                                       f"[0, {pages * ps})")
        if not bool((grid == starts[:, None] + np.arange(ps, dtype=np.int64)).all()):
            raise InvalidArgumentError(f"invalid argument `host_indices`: the {ps} slots of a page must be consecutive")
        if distinct and int(np.unique(starts).size) != len(keys):
            raise InvalidArgumentError("invalid argument `host_indices`: a page appears twice (two pages would be "
                                       "read into it)")
        return idx

    @staticmethod
    def _slot_array(slots: list[int], ps: int) -> np.ndarray:
        return (np.asarray(slots, dtype=np.int64)[:, None] * ps + np.arange(ps, dtype=np.int64)).reshape(-1)

    def get(self, keys: list[str], host_indices: Any, deadline_s: Any = "auto") -> list[bool]:
        """Reads pages into the engine's pool at ``host_indices``; per key, whether it arrived verified in
        time (the engine keeps a leading run). ``deadline_s`` overrides the store's read deadline."""
        deadline = self.read_deadline_s if deadline_s == "auto" else deadline_s
        if deadline is None or self.store.pool is None or not keys:
            return self.store.batch_get_v1(keys, host_indices)
        keys = check_keys(keys)
        idx = self._check(keys, host_indices, distinct=True)
        ps = int(self.store.pool.page_size)
        if deadline == "auto":
            deadline = auto_read_deadline_s(len(keys), ps)
        self._slots()  # (staging pages allocated first, when the pool was registered without prepare())
        until = time.monotonic() + float(deadline)
        return self._run("read", keys, idx, ps, until, None)

    def set(self, keys: list[str], host_indices: Any) -> list[bool]:
        """Writes the pool's pages at ``host_indices``; per key, whether it is durably stored (False: not
        stored in time; it may still be stored later, whole)."""
        if self.write_deadline_s is None or self.store.pool is None or not keys:
            return self.store.batch_set_v1(keys, host_indices)
        keys = check_keys(keys)
        idx = self._check(keys, host_indices, distinct=False)
        ps = int(self.store.pool.page_size)
        return self._run("write", keys, idx, ps, None, self.write_deadline_s)

    def _run(self, kind: str, keys: list[str], idx: np.ndarray, ps: int, until: float | None,
             piece_s: float | None) -> list[bool]:
        """Pieces of the batch through staging pages: reads until ``until`` (the batch's deadline), writes
        each within ``piece_s`` of its start (its queueing behind the batch's earlier pieces included)."""
        gen = self._slots()
        with self._cv:
            # reads in 4 pieces at least (their IO and copies overlap), writes in 2 (each piece ends in a sync)
            per = max(1, min(-(-len(keys) // (4 if kind == "read" else 2)), self._total // 4))
        out = [False] * len(keys)
        todo = list(range(0, len(keys), per))
        pieces: list[_Piece] = []  # every piece that took staging pages, listed as it takes them
        running: dict[concurrent.futures.Future[Any], _Piece] = {}
        batch = object()  # its pieces' misses count once
        stop = give_up = False  # nothing more is sent; what is out is given up
        error: BaseException | None = None
        try:
            while (todo and not stop) or running:
                while todo and not stop:  # send what staging pages are free for
                    if until is not None and time.monotonic() >= until:
                        stop = give_up = True  # the batch's deadline: what is queued is never sent
                        break
                    if running and self.breaker.state != "closed":
                        break  # half-open: the piece out is the probe; the rest follow once it answers
                    lo = todo[0]
                    n = min(per, len(keys) - lo)
                    piece = self._take(n, gen, lo, pieces)
                    if piece is None:
                        if running:
                            break
                        limit = until if until is not None else time.monotonic() + float(piece_s or 0)
                        if self._wait_free(n, gen, limit):
                            continue
                        self.staging_waits_given_up += 1
                        stop = give_up = True
                        break
                    todo.pop(0)
                    fut = self._send(kind, keys[lo:lo + n], idx[lo * ps:(lo + n) * ps], piece, ps, until, piece_s,
                                     batch)
                    if fut is not None:
                        running[fut] = piece
                if not running:
                    break
                timeout = None if until is None else max(0.0, until - time.monotonic())
                done, _ = concurrent.futures.wait(running, timeout=timeout,
                                                  return_when=concurrent.futures.FIRST_COMPLETED)
                if not done:  # the batch's deadline: what is still out is given up now
                    stop = give_up = True
                for fut in done:
                    piece = running.pop(fut)
                    if fut.exception() is not None:  # (a bad argument a tier found: the rest runs out, then raise)
                        error, stop = error or fut.exception(), True
                        continue
                    ok = fut.result()
                    if ok is None:  # given up (deadline, breaker): nothing more is sent
                        stop = give_up = True
                    elif kind == "read":
                        self._land(keys, idx, piece, ok, out, ps)
                    else:
                        out[piece.lo:piece.lo + len(ok)] = ok
                if give_up:
                    for fut in list(running):  # a piece given up: the rest would wait on the same tier
                        self.io.abandon(fut)
        except BaseException:
            for piece in pieces:  # (Ctrl-C) nothing is copied into the pool after this returns
                piece.abandon(self.io)
            raise
        if error is not None:
            raise error
        return out

    def _land(self, keys: list[str], idx: np.ndarray, piece: _Piece, ok: list[bool], out: list[bool],
              ps: int) -> None:
        """Copies the verified pages of a read piece from staging into the pool (this thread), then frees them;
        none when the pool was registered again meanwhile (the staging pages are another generation's)."""
        lo, slots = piece.lo, piece.slots
        try:
            good = [i for i, o in enumerate(ok) if o]
            if good:
                host = np.concatenate([idx[(lo + i) * ps:(lo + i + 1) * ps] for i in good])
                if self.store.copy_staged(True, host, self._slot_array([slots[i] for i in good], ps), piece.gen):
                    for i in good:
                        out[lo + i] = True
        finally:
            piece.give()

    def _send(self, kind: str, keys: list[str], idx: np.ndarray, piece: _Piece, ps: int, until: float | None,
              piece_s: float | None, batch: object) -> concurrent.futures.Future[Any] | None:
        """One piece on the tier's threads (None: not sent, its pool was registered again). Answers: a read's
        results (its staging pages are the caller's to copy and free), a write's results (pages freed), or None
        (given up: pages freed, or fenced until the IO returns)."""
        staged = self._slot_array(piece.slots, ps)
        write, gen = kind == "write", piece.gen
        tier, tier_gen = self.staged_tier, self._tier_gen
        if write:
            try:
                copied = self.store.copy_staged(False, idx, staged, gen)
            except BaseException:
                piece.give()
                raise
            if not copied:
                piece.give()
                return None

        # (the store's tier thread holds no torch object: freeing one there while the interpreter exits aborts it)
        slots = staged if tier is None else None
        tier_slots = torch.from_numpy(staged) if tier is not None else None  # (a chain's tiers take tensors)

        def call() -> list[bool]:
            if tier is None:
                return self.store.batch_staged(write, keys, slots, gen)
            if tier_gen != gen:  # (a chain over another generation's staging pages)
                return [False] * len(keys)
            return tier.batch_set_v1(keys, tier_slots) if write else tier.batch_get_v1(keys, tier_slots)

        def on_done(result: Any, late: bool) -> Any:
            if late or write or isinstance(result, BaseException):
                piece.give()
            else:
                piece.answered()  # (a read in time: the caller copies, then frees; or frees, given up)
            if late:
                return None
            if isinstance(result, BaseException):
                if isinstance(result, InvalidArgumentError):
                    raise result
                return [False] * len(keys)
            return result

        def on_give_up(started: bool) -> None:
            if not started:
                piece.give()
            return None

        deadline = piece_s if until is None else max(0.0, until - time.monotonic())
        piece.submitting = True
        piece.fut = self.io.run(kind, call, deadline_s=deadline, pages=len(piece.slots), on_done=on_done,
                                on_give_up=on_give_up, group=batch)
        return piece.fut

    def use_tier(self, tier: Any, pool: StagingPool | None) -> None:
        """Pieces move through ``tier`` (a chain registered with ``pool``, see :attr:`staged_tier`), or through
        the store alone (None)."""
        self.staged_tier, self._tier_gen = tier, (pool.staging.generation if pool is not None else None)

    def close(self) -> None:
        self.io.close()
