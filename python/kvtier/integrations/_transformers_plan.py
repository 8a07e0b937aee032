"""The measuring half of kvtier's transformers integration: timing the model's forwards through a tier's caches
(what the tier's prefill model learns from), the time to first token of each planned restore, and the short
calibration a new :class:`~kvtier.integrations.transformers.KVTier` runs so its first plan has a prefill model.

Nothing here waits for the GPU: a forward is timed by two CUDA events (the clock on the CPU) and read once the
later one has passed, at the next forward or the next restore."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .transformers import KVTier

#: Tokens of the calibration prompt at most (its largest forward), and its forwards (new tokens, in pages).
CALIBRATION_TOKENS = 4096
CALIBRATION_PAGES = (8, 32, 128)


class Marks:
    """Points in time on the model's device: ``mark()`` now; ``after(start, end, fn)`` calls ``fn(seconds)``
    once ``end`` has passed (polled by :meth:`poll`, never waited for)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self._waiting: list[tuple[Any, Any, Any]] = []

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def after(self, start: Any, end: Any, fn: Any) -> None:
        self._waiting.append((start, end, fn))
        if len(self._waiting) > 256:  # a caller that never polls: keep the newest
            del self._waiting[:128]

    def poll(self, wait: bool = False) -> None:
        keep = []
        for start, end, fn in self._waiting:
            if not self.cuda:
                fn(end - start)
            elif wait or end.query():
                end.synchronize()
                fn(start.elapsed_time(end) / 1e3)
            else:
                keep.append((start, end, fn))
        self._waiting = keep


def before_forward(tier: KVTier, cache: Any, n: int) -> None:
    """The forward pre-hook's part: the start of a forward of ``n`` new tokens through ``cache`` — timed only
    when it says something (a page or more of new tokens, or the forward that may end a time to first token),
    so a decode step makes no event."""
    if tier._observe and (n >= tier.page_size or cache._ttft is not None):
        tier._marks.poll()
        cache._forward = (tier._marks.mark(), n, cache.get_seq_length())


def after_forward(tier: KVTier, cache: Any) -> None:
    """The forward hook's part: the forward's time goes to the prefill model (forwards of a page or more:
    decode steps say little about prefill); the first forward that completes the prompt ends the time to
    first token of the cache's plan."""
    started, cache._forward = cache._forward, None
    if started is None:
        return
    start, n, ctx = started
    end = tier._marks.mark()
    ctrl = tier.controller
    if n >= tier.page_size:
        tier._marks.after(start, end, lambda s: ctrl.observe_prefill(n, ctx, s))
    ttft = cache._ttft
    if ttft is not None and len(cache._fed) >= len(cache._prompt):
        cache._ttft = None
        plan, t0 = ttft
        tier._marks.after(t0, end, lambda s: ctrl.observe_ttft(plan, s))


def calibrate(tier: KVTier, model: Any, cache_kwarg: str, vocab: int, lengths: list[int] | None = None) -> None:
    """A few timed forwards of random tokens through a cache of the tier that restores and keeps nothing
    (pages of increasing length, or ``lengths``; after the longest, a short and a quarter-length forward on
    its context: what reading cached context costs, apart from attending to it), so the prefill model
    predicts from the first request on. Counters are left as they were."""
    from ..controller import Stats
    from ._transformers_cache import KvtierCache
    from .transformers import TransformersStats

    ps = tier.page_size
    room = min(CALIBRATION_TOKENS, tier.host_tokens - 4 * ps,  # (no live cache holds host pages yet)
               int(getattr(model.config, "max_position_embeddings", 0) or CALIBRATION_TOKENS) // 2)
    if lengths is None:
        sizes = [p * ps for p in CALIBRATION_PAGES]
    else:
        room = tier.host_tokens - 4 * ps
        sizes = sorted({int(n) for n in lengths if int(n) > 0})
    sizes = [n for n in sizes if n + 4 * ps + n // 4 <= room]  # the longest and the forwards on its context fit
    if not sizes:
        return
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, max(2, vocab), (1, sizes[-1] + 4 * ps + sizes[-1] // 4), generator=gen).to(tier.device)
    stats, cstats = tier.stats, tier.controller.stats
    tier.stats, tier.controller.stats = TransformersStats(), Stats()
    try:
        with torch.no_grad():
            # each size twice, the first untimed: a GPU's first forward of a shape pays for choosing its kernels
            for timed, n in [(False, 2 * ps), *[(t, n) for n in sizes for t in (False, True)]]:
                tier._observe = timed
                cache = KvtierCache(tier, ids[0, : n + 4 * ps + n // 4].tolist(), restore=False)
                cache._unverified()  # nothing of it is ever kept
                model(input_ids=ids[:, :n], use_cache=True, logits_to_keep=1, **{cache_kwarg: cache})
                if n == sizes[-1]:  # after the longest: a short forward and a long one on its context
                    for m in (2 * ps, max(2 * ps, n // 4 // ps * ps)):  # (tell reading it from attending to it)
                        at = cache.get_seq_length()
                        model(input_ids=ids[:, at : at + m], use_cache=True, logits_to_keep=1, **{cache_kwarg: cache})
                cache.release()
                if n == sizes[-1]:  # and half of it after a quarter of it: attention among new tokens after a context
                    q = max(ps, n // 4 // ps * ps)
                    cache = KvtierCache(tier, ids[0, : q + n // 2 + ps].tolist(), restore=False)
                    cache._unverified()
                    tier._observe = False
                    model(input_ids=ids[:, :q], use_cache=True, logits_to_keep=1, **{cache_kwarg: cache})
                    tier._observe = timed
                    model(input_ids=ids[:, q : q + n // 2], use_cache=True, logits_to_keep=1, **{cache_kwarg: cache})
                    cache.release()
        tier._marks.poll(wait=True)
    finally:
        tier._observe = True
        tier.stats, tier.controller.stats = stats, cstats
