"""Restore planning for engines that cannot split a prefix (SGLang's HiCache, vLLM's offloading tiers): the
engine asks which leading pages a tier holds, and the answer is how many of them are worth loading — fewer
than the tier holds when reading them is predicted slower than the engine computing them, so the engine
recomputes instead of waiting on a slow tier (:func:`kvtier.planner.plan_restore` with ``can_split=False``).

The engine's prefill rate is the operator's (``prefill_tokens_per_s``: what the engine logs as its prefill
throughput for this model, per engine instance), or by default the rate at which a prefill would produce
:data:`DEFAULT_PREFILL_KV_GBPS` of this rank's KV — a deliberately fast engine, so that by default a tier is
loaded from only when it clearly beats recomputation (an engine slower than that loses some reuse, never
time to first token). A tier is judged by what it measured about itself (probe, then its own reads)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from .._errors import InvalidArgumentError
from ..planner import PlannerStats, PrefillModel, TierEstimate, plan_restore

#: Default: the engine's prefill produces this many GB/s of one rank's KV (an H200 prefills Llama-3.1-8B's
#: 128 KiB/token at about 4.3 GB/s; slower engines make loads pay sooner).
DEFAULT_PREFILL_KV_GBPS = 5.0

_log = logging.getLogger(__name__)


def check_options(restore_planner: Any, prefill_tokens_per_s: Any) -> None:
    if not isinstance(restore_planner, bool):
        raise InvalidArgumentError(f"invalid argument `restore_planner`: must be true or false, got {restore_planner!r}")
    if prefill_tokens_per_s is not None and (isinstance(prefill_tokens_per_s, bool) or not isinstance(
            prefill_tokens_per_s, (int, float)) or not prefill_tokens_per_s > 0 or not math.isfinite(prefill_tokens_per_s)):
        raise InvalidArgumentError(f"invalid argument `prefill_tokens_per_s`: must be a number > 0 (the engine's prefill "
                                   f"tokens/s) or null, got {prefill_tokens_per_s!r}")


class EnginePlanner:
    """How many leading pages of a lookup are worth loading (see the module docs). ``enabled=False``: all."""

    def __init__(self, enabled: bool, prefill_tokens_per_s: float | None) -> None:
        check_options(enabled, prefill_tokens_per_s)
        self.enabled = enabled
        self.tokens_per_s = prefill_tokens_per_s
        self.stats = PlannerStats()
        self._prefill: PrefillModel | None = None
        self._said_declined = False

    def prefill(self, bytes_per_token: float) -> PrefillModel:
        if self._prefill is None:
            rate = self.tokens_per_s or DEFAULT_PREFILL_KV_GBPS * 1e9 / max(bytes_per_token, 1.0)
            self._prefill = PrefillModel.fixed(rate, name="prefill_tokens_per_s")
        return self._prefill

    def worth_loading(self, segments: Sequence[tuple[str, int]], *, context_pages: int, page_tokens: int,
                      page_bytes: int, tiers: Mapping[str, TierEstimate]) -> int:
        """Of the pages ``segments`` hold (runs by tier, in order), after ``context_pages`` the engine already
        has, the leading number worth loading."""
        held = sum(n for _, n in segments)
        if not self.enabled or held == 0 or page_tokens <= 0 or page_bytes <= 0:
            return held
        plan = plan_restore(prompt_tokens=(context_pages + held) * page_tokens + 1, page_tokens=page_tokens,
                            page_bytes=page_bytes, host_pages=context_pages, store_segments=segments, tiers=tiers,
                            prefill=self.prefill(page_bytes / page_tokens), can_split=False)
        self.stats.record(plan)
        if plan.loaded_pages < held and not self._said_declined:
            self._said_declined = True  # (once: every later decline is counted, `declined_tokens`)
            rate = (f"its prefill_tokens_per_s of {self.tokens_per_s:g}" if self.tokens_per_s else
                    f"the default prefill rate ({DEFAULT_PREFILL_KV_GBPS:g} GB/s of this rank's KV; "
                    "prefill_tokens_per_s not set)")
            seen = ", ".join(f"{n}: " + (f"{t.read_GBps:.2f} GB/s, {t.read_latency_s * 1e3:.1f} ms latency"
                                           if t.read_GBps > 0 else "not measured yet")
                             for n in dict.fromkeys(n for n, _ in segments) if (t := tiers.get(n)) is not None)
            _log.warning("kvtier: the restore planner reports %d of %d stored pages of a lookup to the engine: reading "
                         "the rest (%s) is not predicted faster, by the planner's margin, than the engine recomputing "
                         "them at %s. Declined pages are counted (kvtier_restore_declined_tokens_total); set "
                         "prefill_tokens_per_s to the engine's measured prefill rate, or restore_planner: false to "
                         "report every stored page. Said once.", plan.loaded_pages, held, seen or "no measurement", rate)
        return plan.loaded_pages
