"""The calibration of kvtier's transformers integration: the few timed forwards a new
:class:`~kvtier.integrations.transformers.KVTier` runs so that its first restore plan has a prefill model (every
later forward through a cache is timed by that cache's hooks, on the runtime's clock)."""

from __future__ import annotations

from typing import Any

import torch

from ...controller import Stats
from .cache import KvtierCache
from .state import TierRuntime, TransformersStats

#: Tokens of the calibration prompt at most (its largest forward), and its forwards (new tokens, in pages).
CALIBRATION_TOKENS = 4096
CALIBRATION_PAGES = (8, 32, 128)


def calibrate(tier: Any, state: TierRuntime, model: Any, vocab: int, lengths: list[int] | None = None) -> None:
    """A few timed forwards of random tokens through a cache of ``tier`` (``state``: its runtime) that restores
    and keeps nothing (pages of increasing length, or ``lengths``; after the longest, a short and a
    quarter-length forward on its context: what reading cached context costs, apart from attending to it), so
    the prefill model predicts from the first request on. Counters are left as they were."""
    ps, kw = state.page_size, state.cache_kwarg
    room = min(CALIBRATION_TOKENS, state.host_tokens - 4 * ps,  # (no live cache holds host pages yet)
               int(getattr(model.config, "max_position_embeddings", 0) or CALIBRATION_TOKENS) // 2)
    if lengths is None:
        sizes = [p * ps for p in CALIBRATION_PAGES]
    else:
        room = state.host_tokens - 4 * ps
        sizes = sorted({int(n) for n in lengths if int(n) > 0})
    sizes = [n for n in sizes if n + 4 * ps + n // 4 <= room]  # the longest and the forwards on its context fit
    if not sizes:
        return
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, max(2, vocab), (1, sizes[-1] + 4 * ps + sizes[-1] // 4), generator=gen).to(state.device)
    stats, cstats = state.stats, state.controller.stats
    state.stats, state.controller.stats = TransformersStats(), Stats()
    try:
        with torch.no_grad():
            # each size twice, the first untimed: a GPU's first forward of a shape pays for choosing its kernels
            for timed, n in [(False, 2 * ps), *[(t, n) for n in sizes for t in (False, True)]]:
                state.observe = timed
                cache = KvtierCache(tier, state, ids[0, : n + 4 * ps + n // 4].tolist(), restore=False, keep=False)
                model(input_ids=ids[:, :n], use_cache=True, logits_to_keep=1, **{kw: cache})
                if n == sizes[-1]:  # after the longest: a short forward and a long one on its context
                    for m in (2 * ps, max(2 * ps, n // 4 // ps * ps)):  # (tell reading it from attending to it)
                        at = cache.get_seq_length()
                        model(input_ids=ids[:, at : at + m], use_cache=True, logits_to_keep=1, **{kw: cache})
                cache.release()
                if n == sizes[-1]:  # and half of it after a quarter of it: attention among new tokens after a context
                    q = max(ps, n // 4 // ps * ps)
                    cache = KvtierCache(tier, state, ids[0, : q + n // 2 + ps].tolist(), restore=False, keep=False)
                    state.observe = False
                    model(input_ids=ids[:, :q], use_cache=True, logits_to_keep=1, **{kw: cache})
                    state.observe = timed
                    model(input_ids=ids[:, q : q + n // 2], use_cache=True, logits_to_keep=1, **{kw: cache})
                    cache.release()
        state.marks.poll(wait=True)
    finally:
        state.observe = True
        state.stats, state.controller.stats = stats, cstats
