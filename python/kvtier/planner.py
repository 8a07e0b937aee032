"""Deciding every restore with measurements: load a cached prefix, recompute it, or both at once.

A cached prefix pays only when bringing it back is faster than computing it again. Which one wins depends on
the tier (pinned host memory at tens of GB/s; a local disk anywhere from 1 to 7 GB/s; a cluster store behind
a network) and on the engine (how fast its GPU prefills this model at this context length). kvtier decides
with three measured inputs:

- :class:`TierMeter`: what each tier measured about itself — read and write GB/s, the fixed cost of a batch,
  the recent hit rate — a moving estimate over kvtier's own transfers, seeded by a short probe when the tier
  opens (:class:`TierEstimate` is one reading of it).
- :class:`PrefillModel`: the engine's prefill time for ``n`` new tokens after ``ctx`` cached ones,
  ``a + b·n + c·n·ctx + d·ctx + e·n²/2`` (fixed cost, per-token work, attention to the cached context,
  reading the cached context, attention within the new tokens — ``f`` instead of ``e`` after a cached context,
  where engines leave their fused causal kernel for a masked one),
  fitted online from the engine's own forwards, or given by the caller (:meth:`PrefillModel.fixed`).
- the request: its length, and which of its leading pages each tier holds (host first, then the store's
  tiers in order).

:func:`plan_restore` turns them into a :class:`RestorePlan`: the leading pages taken from the host, the
pages recomputed, the pages loaded from each slower tier, and the predicted time to first token. Recomputing
everything is always a candidate, so no plan is ever predicted slower than it. An engine that drives its
own forward (``can_split=True``; kvtier's transformers cache) may recompute the head of the cached prefix
while the tail streams from the store, the two meeting where they finish together (Cake, arXiv 2410.03065);
an engine that cannot (SGLang, vLLM) gets the number of leading pages worth loading.

Everything here is plain arithmetic on numbers kvtier measured; nothing touches a tier.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._errors import InvalidArgumentError
from ._tier_meter import WINDOW, TierEstimate, TierMeter  # noqa: F401 - kvtier.planner.TierMeter stays the public path


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (columns scaled; a negative one is dropped and the rest
    refitted, at most once per column): enough for the four terms of the prefill model."""
    scale = np.maximum(np.abs(x).max(axis=0), 1e-30)
    xs = x / scale
    active = [i for i in range(x.shape[1]) if np.any(xs[:, i] != 0)]
    coef = np.zeros(x.shape[1])
    for _ in range(x.shape[1]):
        if not active:
            break
        sol, *_ = np.linalg.lstsq(xs[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef / scale


class PrefillModel:
    """The engine's prefill time, ``seconds(n, ctx) = a + b·n + c·n·ctx + d·ctx + (e or f)·n²/2`` for ``n`` new
    tokens after ``ctx`` cached ones (thread-safe). Fitted with non-negative coefficients, minimising the
    relative error, over the last :data:`WINDOW` forwards the engine reported (:meth:`observe`), or fixed by the caller
    (:meth:`fixed`, or ``coefficients``). Predicts nothing (``None``) until it has a fit."""

    def __init__(self, coefficients: Sequence[float] | None = None, *, window: int = WINDOW) -> None:
        self._obs: collections.deque[tuple[int, int, float]] = collections.deque(maxlen=window)
        self._lock = threading.Lock()
        self._fixed = coefficients is not None
        self._coef: np.ndarray | None = None
        if coefficients is not None:
            c = [float(v) for v in coefficients]
            if len(c) not in (4, 5, 6) or any(not math.isfinite(v) or v < 0 for v in c):
                raise InvalidArgumentError("invalid argument `coefficients`: four to six finite values >= 0 (a, b, c, d[, e[, "
                                           f"f]]; e defaults to c, f to e), got {coefficients!r}")
            c = c + [c[2]] * (len(c) == 4)
            self._coef = np.array(c + [c[4]] * (len(c) == 5))

    @classmethod
    def fixed(cls, tokens_per_s: float, *, overhead_s: float = 0.0, name: str = "tokens_per_s") -> PrefillModel:
        """A prefill rate the operator knows (e.g. from the engine's own logs): ``n / tokens_per_s``. ``name``:
        the argument a bad rate is reported as (the caller's own)."""
        if isinstance(tokens_per_s, bool) or not isinstance(tokens_per_s, (int, float)) or not tokens_per_s > 0 \
                or not math.isfinite(tokens_per_s):
            raise InvalidArgumentError(f"invalid argument `{name}`: must be a number > 0 (prefill tokens/s), got "
                                       f"{tokens_per_s!r}")
        return cls((overhead_s, 1.0 / float(tokens_per_s), 0.0, 0.0, 0.0, 0.0))

    @property
    def learned(self) -> bool:
        """Fitted from observations (not fixed by the caller)."""
        return not self._fixed

    @property
    def samples(self) -> int:
        with self._lock:
            return len(self._obs)

    def observe(self, n: int, ctx: int, seconds: float) -> None:
        """One forward of ``n`` new tokens after ``ctx`` cached ones took ``seconds`` (ignored when fixed)."""
        if self._fixed or n <= 0 or ctx < 0 or not (seconds > 0 and math.isfinite(seconds)):
            return
        with self._lock:
            self._obs.append((int(n), int(ctx), float(seconds)))
            self._coef = None  # refitted on the next prediction

    @staticmethod
    def _features(n: float, ctx: float) -> list[float]:
        return [1.0, n, n * ctx, ctx, n * n / 2.0 * (ctx == 0), n * n / 2.0 * (ctx > 0)]

    def coefficients(self) -> tuple[float, float, float, float, float, float] | None:
        """``(a, b, c, d, e, f)`` of the current fit, or None before any observation."""
        with self._lock:
            if self._coef is None:
                if not self._obs:
                    return None
                # relative errors count (a 20 ms forward predicted as 40 ms is as wrong as 2 s as 4 s): each
                # observation weighted by 1 / its time
                x = np.array([self._features(n, c) for n, c, _ in self._obs])
                y = np.array([s for _, _, s in self._obs])
                self._coef = _nnls(x / y[:, None], np.ones_like(y))
            a, b, c, d, e, f = (float(v) for v in self._coef)
        return a, b, c, d, e, f

    def seconds(self, n: int, ctx: int) -> float | None:
        """Predicted seconds of a forward of ``n`` new tokens after ``ctx`` cached ones (0 for none)."""
        out = self.predict(np.asarray([n], dtype=np.float64), np.asarray([ctx], dtype=np.float64))
        return None if out is None else float(out[0])

    def predict(self, n: np.ndarray, ctx: np.ndarray) -> np.ndarray | None:
        """:meth:`seconds` over arrays (broadcast), or None before any fit. A learned model corrects its fit by
        the forwards it observed near each point (within about 1.5x in new and in cached tokens: their
        measured/fitted ratios, weighted by closeness), so a shape the engine has run is predicted as it
        ran even where the six terms cannot follow the engine's curve exactly."""
        coef = self.coefficients()
        if coef is None:
            return None
        a, b, c, d, e, f = coef

        def curve(n: np.ndarray, ctx: np.ndarray) -> np.ndarray:
            return a + b * n + c * n * ctx + d * ctx + np.where(ctx > 0, f, e) * n * n / 2.0

        n, ctx = np.broadcast_arrays(np.asarray(n, dtype=np.float64), np.asarray(ctx, dtype=np.float64))
        fit = curve(n, ctx)
        with self._lock:
            obs = list(self._obs) if not self._fixed else []
        if obs:
            on = np.array([o[0] for o in obs], dtype=np.float64)
            oc = np.array([o[1] for o in obs], dtype=np.float64)
            os_ = np.array([o[2] for o in obs], dtype=np.float64)
            ofit = curve(on, oc)
            ratio = np.where(ofit > 0, os_ / np.maximum(ofit, 1e-12), 1.0)
            # distance in (log new tokens, log cached tokens), in units of log 1.5
            dn = (np.log(np.maximum(n, 1.0))[..., None] - np.log(np.maximum(on, 1.0))) / math.log(1.5)
            dc = (np.log1p(ctx)[..., None] - np.log1p(oc)) / math.log(1.5)
            w = np.exp(-(dn * dn + dc * dc))
            fit = fit * (0.1 + (w * ratio).sum(-1)) / (0.1 + w.sum(-1))  # (a weak prior: the fit itself)
        return np.where(n > 0, fit, 0.0)


@dataclass
class RestorePlan:
    """What to do with a request's cached prefix (pages of ``page_tokens`` tokens):

    - pages ``[0, host_pages)`` are taken from the host pool;
    - pages ``[host_pages, recompute_to)`` are recomputed (the *head*; empty unless the plan splits);
    - pages ``[recompute_to, load_to)`` are loaded from the slower tiers, ``load`` saying how many from
      which tier in order; with a head, the load runs while the head is computed;
    - the rest of the prompt, tokens ``[load_to · page_tokens, prompt_tokens)``, is computed last.

    ``kind``: ``"recompute"`` (nothing reused), ``"host"`` (host pages only), ``"load"`` (store pages
    loaded, nothing recomputed before them) or ``"split"``. ``predicted_s`` is the plan's predicted time to
    first token and ``recompute_s`` recomputing the whole prompt's, both from the same model (``None`` when
    the prefill cost is not known yet: the plan then is what the tiers hold, as before planning)."""

    prompt_tokens: int
    page_tokens: int
    host_pages: int = 0
    recompute_to: int = 0
    load_to: int = 0
    load: list[tuple[str, int]] = field(default_factory=list)
    predicted_s: float | None = None
    recompute_s: float | None = None
    kind: str = "recompute"
    cached_pages: int = 0  # the leading pages some tier holds (what was available)
    #: the best predicted time of each kind of plan considered (``recompute``, ``host``, ``load``, ``split``)
    candidates: dict[str, float] = field(default_factory=dict)
    #: which tier holds the pages after the host's (``[(tier, pages)]`` from ``host_pages`` on, in order)
    segments: list[tuple[str, int]] = field(default_factory=list)
    #: what the plan was chosen by: its predicted time over ``1 - margin`` of its kind (:func:`plan_restore`);
    #: never higher with one more cached page, unless the split trails (``trail``: its tail reads through the
    #: last cached page, so a slow page at the end can cost the split)
    score: float | None = None

    @property
    def reused_pages(self) -> int:
        """Pages whose KV is not computed again (host + loaded)."""
        return self.host_pages + (self.load_to - self.recompute_to)

    @property
    def loaded_pages(self) -> int:
        return self.load_to - self.recompute_to

    @property
    def recomputed_tokens(self) -> int:
        """Tokens of the prompt computed: the head and the rest."""
        return self.prompt_tokens - self.reused_pages * self.page_tokens

    @property
    def speedup(self) -> float | None:
        if self.predicted_s is None or self.recompute_s is None or self.predicted_s <= 0:
            return None
        return self.recompute_s / self.predicted_s

    def as_dict(self) -> dict[str, object]:
        return dict(kind=self.kind, prompt_tokens=self.prompt_tokens, page_tokens=self.page_tokens,
                    host_pages=self.host_pages, recompute_to=self.recompute_to, load_to=self.load_to,
                    load=list(self.load), cached_pages=self.cached_pages, predicted_s=self.predicted_s,
                    recompute_s=self.recompute_s, candidates=dict(self.candidates), segments=list(self.segments),
                    score=self.score)


def _segments_between(segments: Sequence[tuple[str, int]], first: int, last: int) -> list[tuple[str, int]]:
    """The part of ``segments`` (consecutive runs of pages, by tier) covering pages ``[first, last)``
    counted from the segments' start."""
    out, pos = [], 0
    for name, n in segments:
        lo, hi = max(pos, first), min(pos + n, last)
        if hi > lo:
            out.append((name, hi - lo))
        pos += n
    return out


def plan_restore(
    *,
    prompt_tokens: int,
    page_tokens: int,
    page_bytes: int,
    host_pages: int,
    store_segments: Sequence[tuple[str, int]] = (),
    tiers: Mapping[str, TierEstimate] | None = None,
    prefill: PrefillModel | None = None,
    can_split: bool = True,
    margin: float = 0.02,
    split_margin: float = 0.10,
    split_step: int = 4,
    overlap: bool = False,
    trail: bool = False,
    trail_margin: float = 0.10,
) -> RestorePlan:
    """The fastest predicted plan for a request (see :class:`RestorePlan`).

    Args:
        prompt_tokens: the prompt's length; at least its last token is always computed (the engine needs
            its logits), so at most ``(prompt_tokens - 1) // page_tokens`` pages are reused.
        page_tokens, page_bytes: a page's tokens and its bytes (every layer, K and V).
        host_pages: the leading run of pages in the host pool.
        store_segments: the pages after them, by tier, in order (``[("disk", 40), ("mooncake", 8)]``).
        tiers: each store tier's estimate (:meth:`TierMeter.estimate`). A tier with no figure yet (never
            probed, never read: a read-only follower, a cluster tier) is loaded from as if it cost nothing,
            so its first reads measure it.
        prefill: the engine's prefill model; until it predicts, the plan takes every cached page (as
            kvtier did before planning) and predicts nothing.
        can_split: the engine can recompute the head of the prefix while its tail loads (two forwards).
        margin: a plan that reuses stored pages must be predicted at least this fraction faster than the
            best plan without them, so a close call never makes time to first token worse. Each kind of plan is
            scored by its predicted time over ``1 - margin`` (``1 - split_margin`` for a split, 1 for the
            others) and the lowest score wins; a load and a split's tail may stop at any cached page, so one more
            cached page never raises the winning score (:attr:`RestorePlan.score`) when the split does not
            trail. A trailing split's tail reads through the last cached page (see ``trail``): there a slow page
            at the end can make the split lose to recomputing.
        split_margin: a split (a second forward, IO beside compute) must be predicted at least this fraction
            faster than the best plan without one (on the H200 a split ran 3-21% over its prediction while
            every other kind stayed within 10%).
        split_step: the head ends on a multiple of this many pages, so heads repeat their shapes (a GPU's
            first forward of a new shape pays for choosing its kernels). On the H200's 8K split (pages of 64
            tokens) 8 pages were 16 ms of head and 42 ms of read (``h200-probe-split-curve.json``), so the best
            head on that grid could leave the head and the read about 30 ms apart; 4 halves that.
        overlap: the engine queues the forward of the rest of the prompt before the store's read has finished
            (kvtier's transformers cache on CUDA: the loads wait on the device, behind a gate): when that
            forward is bound by its host time (the prefill model's fixed per-forward term larger than the rest
            of its predicted time), that time runs while the device computes the head or waits for the read,
            and only the device's part remains after them.
        trail: with ``overlap``, the rest's forward also follows the head layer by layer (each of its layers
            waits for that layer's head and tail only: kvtier's transformers cache with every layer resident).
            A host-bound rest then costs almost nothing after a head that ends last, while after a read that
            ends last it still pays its device part — and on the H200 more: its forward, queued behind the
            read, fills the GPU's launch queue, so the host queues its last layers only once the read is done.
            Heads are chosen so that the read ends first by ``trail_margin`` of its predicted time.
        trail_margin: see ``trail``.
    """
    for name, v in (("prompt_tokens", prompt_tokens), ("page_tokens", page_tokens), ("page_bytes", page_bytes)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise InvalidArgumentError(f"invalid argument `{name}`: must be a positive int, got {v!r}")
    if not (isinstance(trail_margin, (int, float)) and trail_margin >= 0):
        raise InvalidArgumentError(f"invalid argument `trail_margin`: must be a number >= 0, got {trail_margin!r}")
    if isinstance(host_pages, bool) or not isinstance(host_pages, int) or host_pages < 0:
        raise InvalidArgumentError(f"invalid argument `host_pages`: must be an int >= 0, got {host_pages!r}")
    for name, figure in dict(tiers or {}).items():  # a rate or a latency that is no figure is refused, never planned
        rate, lat = getattr(figure, "read_GBps", None), getattr(figure, "read_latency_s", None)
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                   for v in (rate, lat)):
            raise InvalidArgumentError(f"invalid argument `tiers`: tier {name!r} has read_GBps {rate!r} and "
                                       f"read_latency_s {lat!r}; each must be a finite number >= 0 (0 GB/s: unknown)")
    segs = [(str(n), int(p)) for n, p in store_segments if int(p) > 0]
    if any(p < 0 for _, p in store_segments):
        raise InvalidArgumentError(f"invalid argument `store_segments`: negative page counts in {store_segments!r}")
    limit = (prompt_tokens - 1) // page_tokens  # pages that may be reused at most
    h = min(host_pages, limit)
    segs = _segments_between(segs, 0, max(0, limit - h))
    cached = h + sum(p for _, p in segs)
    ps = page_tokens
    tiers = dict(tiers or {})

    def full(kind: str, host: int, j: int, k: int, predicted: float | None, recompute: float | None) -> RestorePlan:
        return RestorePlan(prompt_tokens, ps, host, j, k, _segments_between(segs, j - h, k - h), predicted,
                           recompute, kind, cached, segments=list(segs))

    coef = prefill.coefficients() if prefill is not None else None
    if coef is None:  # nothing to decide with: take what the tiers hold
        return full("load" if cached > h else "host" if h else "recompute", h, h, cached, None, None)
    N = float(prompt_tokens)

    def P(n: Any, ctx: Any) -> Any:
        """The prefill model over arrays (0 for no new tokens)."""
        return prefill.predict(n, ctx)  # type: ignore[union-attr]

    recompute = float(P(N, 0.0))
    seen = {"recompute": recompute}
    # each kind's best plan, and its score: the predicted time, over (1 - margin) for the kinds that need one
    plans, score = {"recompute": full("recompute", 0, 0, 0, recompute, recompute)}, {"recompute": recompute}

    def chosen() -> RestorePlan:
        kind = min(score, key=lambda k: score[k])
        best = plans[kind]
        best.candidates, best.score = seen, score[kind]
        return best

    if h:
        t = seen["host"] = score["host"] = float(P(N - h * ps, h * ps))
        plans["host"] = full("host", h, h, h, t, recompute)
    m = cached - h
    if m <= 0:
        return chosen()
    # pages h .. cached-1 by tier: per tier, how many of the first p pages it holds (p = 0 .. m)
    owner = np.concatenate([np.full(n, ti) for ti, (_, n) in enumerate(segs)])
    cum, fixed, per_page = [], [], []
    for ti, (name, _) in enumerate(segs):
        est = tiers.get(name)
        known = est is not None and est.known
        cum.append(np.concatenate([[0], np.cumsum(owner == ti)]))
        fixed.append(est.read_latency_s if known else 0.0)  # type: ignore[union-attr]
        per_page.append(page_bytes / (est.read_GBps * 1e9) if known else 0.0)  # type: ignore[union-attr]

    def read(first: Any, last: Any) -> Any:
        """Seconds to read pages [h + first, h + last), one batch per tier in order (arrays)."""
        total = np.zeros(np.broadcast(first, last).shape)
        for cu, lat, pp in zip(cum, fixed, per_page):
            cnt = cu[last] - cu[first]
            total = total + np.where(cnt > 0, lat, 0.0) + cnt * pp
        return total

    # load [h, h + p) and compute the rest (p < m: stop before a slow tier late in the run)
    p = np.arange(1, m + 1)
    # loading more of the prefix never makes the rest of the forward slower (a fitted model of noisy timings can
    # say otherwise), and among loads predicted within 1 % of the best the longest is taken: a model whose
    # per-token terms are lost in the noise (a small model on a CPU) predicts the same forward for any split,
    # and the read's few microseconds per page would then stop a free load after one page
    # the rest's host time hidden by the read (or the head) when the engine queues it early: the fixed term,
    # for a rest bound by it (its other terms, the device's work, below it); a longer rest is bound by the device
    a = float(coef[0]) if overlap else 0.0

    def hidden(rest: Any) -> Any:
        return np.where(rest - a <= a, a, 0.0)

    rest = np.minimum.accumulate(np.broadcast_to(P(N - (h + p) * ps, (h + p) * ps), p.shape))
    host = hidden(rest)
    t = np.maximum(read(0, p), host) + rest - host
    best_t = float(np.min(t))
    i = int(np.nonzero(t <= best_t + max(0.01 * best_t, 1e-9))[0][-1])
    seen["load"], score["load"] = best_t, best_t / (1.0 - margin)
    plans["load"] = full("load", h, h, h + int(p[i]), float(t[i]), recompute)
    if can_split and m > max(1, split_step):  # recompute the head [h, h + p) while the tail [h + p, h + q) loads
        # A tail may end at any cached page q (the rest's forward computing [h + q, cached) too), so one more
        # cached page never makes the best split worse; trailing (the rest's forward following the head layer by
        # layer) the tail reads through the last cached page: a shorter one there left the trailing rest over
        # pages the read did not bring, which the H200 did not run bit-exact (benches/RESULTS.md, the planner's
        # scoring).
        p = np.arange(max(1, split_step), m, max(1, split_step))
        q = np.arange(1, m + 1) if not (trail and overlap) else np.array([m])
        rest_q = np.minimum.accumulate(np.broadcast_to(P(N - (h + q) * ps, (h + q) * ps), q.shape))
        host_q = hidden(rest_q)
        head_t = P(p * ps, h * ps)[:, None]
        read_t = read(p[:, None], q[None, :])
        rest_t, host_t = rest_q[None, :], host_q[None, :]
        if trail and overlap and float(host_q[-1]) > 0:  # the rest trails the head: after a head that ends last it is free
            t = np.maximum(np.maximum(head_t, read_t + rest_t - host_t), 2 * host_t)
            # the head chosen so that the read ends first by trail_margin of its time (scored by that too, so
            # the score never rises with more cached pages)
            obj = np.maximum(np.maximum(head_t, read_t * (1.0 + trail_margin) + rest_t - host_t), 2 * host_t)
        else:
            obj = t = np.maximum(np.maximum(head_t, read_t), 2 * host_t) + rest_t - host_t
        obj = np.where(q[None, :] > p[:, None], obj, np.inf)  # (a tail of at least one page)
        # of the heads and tails predicted alike, the longest tail (the most pages reused), then the shortest head
        best_obj = float(np.min(obj))
        ties = np.nonzero(obj <= best_obj + max(1e-9 * best_obj, 1e-15))
        k = int(np.lexsort((ties[0], -ties[1]))[0])
        i, jq = int(ties[0][k]), int(ties[1][k])
        seen["split"] = float(t[i, jq])
        score["split"] = float(obj[i, jq]) / (1.0 - split_margin)
        plans["split"] = full("split", h, h + int(p[i]), h + int(q[jq]), float(t[i, jq]), recompute)
    return chosen()


#: A plan whose time to first token came out more than this fraction over its prediction is a *slow plan*:
#: counted by kind, kept among the recent ones with its plan, and logged (``kvtier.planner``).
SLOW_MARGIN = 0.10
_log = logging.getLogger("kvtier.planner")


class PlannerStats:
    """Every restore decision, counted (thread-safe): plans by kind, tokens taken from each tier (``host``
    and the store's tiers by name) and tokens recomputed, and — for the plans whose time to first token
    the engine reported — predicted against observed, with the slow plans (:data:`SLOW_MARGIN`) counted,
    the last 16 kept with their plans and logged (the first 10, then every 100th)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.plans: collections.Counter[str] = collections.Counter()
        self.tokens_loaded: collections.Counter[str] = collections.Counter()
        self.tokens_recomputed = 0
        self.cached_tokens = 0  # tokens some tier held (what could have been reused)
        self.declined_tokens = 0  # of those, tokens the chosen plans computed again instead
        self.observed = 0
        self.predicted_s = 0.0  # sums over the observed plans
        self.observed_s = 0.0
        self._ratios: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.slow_plans: collections.Counter[str] = collections.Counter()  # by kind
        self.recent_slow: collections.deque[dict[str, object]] = collections.deque(maxlen=16)

    def record(self, plan: RestorePlan) -> None:
        with self._lock:
            self.plans[plan.kind] += 1
            if plan.host_pages:
                self.tokens_loaded["host"] += plan.host_pages * plan.page_tokens
            for name, n in plan.load:
                self.tokens_loaded[name] += n * plan.page_tokens
            self.tokens_recomputed += plan.recomputed_tokens
            self.cached_tokens += plan.cached_pages * plan.page_tokens
            self.declined_tokens += max(0, plan.cached_pages - plan.reused_pages) * plan.page_tokens

    def observe(self, plan: RestorePlan, seconds: float) -> None:
        """The time to first token the engine measured for ``plan``."""
        if plan.predicted_s is None or not (seconds > 0 and math.isfinite(seconds)):
            return
        with self._lock:
            self.observed += 1
            self.predicted_s += plan.predicted_s
            self.observed_s += seconds
            self._ratios.append(plan.predicted_s / seconds)
            if seconds <= plan.predicted_s * (1.0 + SLOW_MARGIN):
                return
            self.slow_plans[plan.kind] += 1
            n = sum(self.slow_plans.values())
            self.recent_slow.append(dict(plan.as_dict(), observed_s=seconds))
        if n <= 10 or n % 100 == 0:
            _log.warning("kvtier: a %s restore took %.1f ms, %.0f%% over its prediction of %.1f ms (slow plan %d; "
                         "%s)", plan.kind, seconds * 1e3, (seconds / plan.predicted_s - 1) * 100,
                         plan.predicted_s * 1e3, n, plan.as_dict())

    def median_error(self) -> float | None:
        """Median of ``|predicted / observed - 1|`` over the last :data:`WINDOW` observed plans."""
        with self._lock:
            r = list(self._ratios)
        return float(np.median(np.abs(np.array(r) - 1.0))) if r else None

    def as_dict(self) -> dict[str, object]:
        err = self.median_error()
        with self._lock:
            return dict(plans=dict(self.plans), tokens_loaded=dict(self.tokens_loaded),
                        tokens_recomputed=self.tokens_recomputed, cached_tokens=self.cached_tokens,
                        declined_tokens=self.declined_tokens,
                        observed=self.observed, predicted_s=self.predicted_s, observed_s=self.observed_s,
                        median_prediction_error=err, slow_plans=dict(self.slow_plans),
                        recent_slow_plans=list(self.recent_slow))
