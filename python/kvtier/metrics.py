"""Prometheus metrics for operators: per-tier hits and misses, bytes per path, batch latency histograms, write
failures, corrupt reads and dropped journal records, for a :class:`~kvtier.TierController`, any number of
:class:`~kvtier.PageStore` s, and SGLang's :class:`~kvtier.integrations.sglang.KvtierStorage`.

    from prometheus_client import start_http_server, REGISTRY
    from kvtier.metrics import KvtierCollector

    REGISTRY.register(KvtierCollector(controller=ctrl, stores=[store]))
    start_http_server(9400)          # scrape http://host:9400/metrics

Needs ``prometheus-client`` (``pip install 'kvtier[metrics]'``); the collector reads the objects' counters on
each scrape (nothing is sampled in between), so it costs nothing while nobody scrapes. Latency histograms
(:class:`LatencyHistogram`) are kept by the objects themselves whether or not this module is used.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

#: upper bounds (seconds) of the batch latency histograms: 100 µs … 10 s
BUCKETS: tuple[float, ...] = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LatencyHistogram:
    """A thread-safe cumulative histogram of durations in seconds (Prometheus semantics, no dependency)."""

    def __init__(self, buckets: Sequence[float] = BUCKETS) -> None:
        self.buckets = tuple(buckets)
        self._counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        i = bisect.bisect_left(self.buckets, seconds)
        with self._lock:
            self._counts[i] += 1
            self._sum += seconds

    def snapshot(self) -> tuple[list[tuple[str, int]], float, int]:
        """``(cumulative buckets [(le, count)], sum, count)``."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        out, acc = [], 0
        for le, c in zip([*map(str, self.buckets), "+Inf"], counts):
            acc += c
            out.append((le, acc))
        return out, total, acc


def require_prometheus() -> Any:
    """``prometheus_client.core``, or a :class:`~kvtier.KvtierError` saying how to install it."""
    try:
        from prometheus_client import core
    except ImportError:
        from ._errors import KvtierError

        raise KvtierError("kvtier.metrics needs prometheus-client: pip install 'kvtier[metrics]' "
                          "(or prometheus-client)") from None
    return core


#: PageStore counters exported as Prometheus counters: (stats key, metric suffix, help)
_STORE_COUNTERS = (
    ("hits", "hits", "pages found and verified (objects: K and V count separately)"),
    ("misses", "misses", "lookups of objects the store does not hold"),
    ("bytes_written", "written_bytes", "bytes durably written"),
    ("bytes_read", "read_bytes", "bytes read and verified"),
    ("puts", "puts", "objects written"),
    ("write_failures", "write_failures", "objects whose write failed (full disk, IO error): reported False, never raised"),
    ("read_failures", "read_failures", "objects whose read failed with an IO error (a miss)"),
    ("corrupt_reads", "corrupt_reads", "objects that failed their checksum on read (a miss; the object is dropped)"),
    ("evictions", "evictions", "objects evicted to stay within capacity_bytes"),
    ("journal_failures", "journal_failures", "journal appends that failed (the batch's pages reported False)"),
    ("compactions", "journal_compactions", "journal compactions"),
    ("raw_bytes_written", "written_content_bytes", "what the objects written hold (coded objects: their decoded "
     "bytes); over written_bytes, the ratio the codec achieved"),
    ("decoded_bytes", "decoded_bytes", "bytes decoded from coded objects on read"),
)
#: PageStore values exported as gauges
_STORE_GAUGES = (
    ("objects", "objects", "objects stored"),
    ("bytes_used", "used_bytes", "bytes in occupied slots"),
    ("capacity_bytes", "capacity_bytes", "the namespace's capacity limit (data blocks plus journal)"),
    ("data_bytes_held", "data_held_bytes", "disk blocks held by the data files"),
    ("journal_bytes_held", "journal_held_bytes", "disk blocks held by the journal"),
    ("dropped_records", "dropped_records", "journal records dropped at open (naming bytes the data files lack)"),
    ("journal_damaged_spans", "journal_damaged_spans", "damaged journal spans skipped at open"),
    ("poisoned", "poisoned", "1 while a failed journal cut-back keeps the store from writing (until reopened)"),
    ("compression_ratio", "compression_ratio", "bytes the stored objects hold per byte they take (1 with nothing "
     "compressed)"),
    ("decode_GBps_per_thread", "decode_gbps_per_thread", "decoding of coded objects on read, GB/s of decoded bytes per "
     "thread (0 before any)"),
)
_CONTROLLER_PAGES = (
    ("backed_up_pages", "backup"), ("loaded_pages", "load"), ("store_writes", "store_write"),
    ("prefetched_pages", "prefetch"), ("spills", "spill"),
)
_CONTROLLER_BYTES = (
    ("bytes_device_to_host", "device_to_host"), ("bytes_host_to_device", "host_to_device"),
    ("bytes_to_store", "host_to_disk"), ("bytes_from_store", "disk_to_host"),
)


class KvtierCollector:
    """A Prometheus collector (``REGISTRY.register(KvtierCollector(...))``) over live kvtier objects.

    Args:
        controller: a :class:`~kvtier.TierController` (its store is included).
        stores: further :class:`~kvtier.PageStore` s (or SGLang ``KvtierStorage`` backends, whose page store
            and extra v2 pools are included).
        prefix: metric name prefix (default ``kvtier``).
    """

    def __init__(self, *, controller: Any = None, stores: Sequence[Any] = (), prefix: str = "kvtier") -> None:
        require_prometheus()  # fail at construction, not at the first scrape
        self.controller = controller
        self.stores = list(stores)
        self.prefix = prefix

    def _page_stores(self) -> list[Any]:
        out: list[Any] = []
        cands = ([self.controller.store] if self.controller is not None and self.controller.store is not None else [])
        for s in [*cands, *self.stores]:
            if hasattr(s, "tiers") and hasattr(s, "first"):  # a TieredStore: its disk tier
                out.append(s.first)
            elif hasattr(s, "store") and hasattr(s, "kvtier_stats"):  # an engine backend (KvtierStorage, KvtierTier)
                if s.store is not None:  # (None: a vLLM tier after shutdown)
                    out.append(s.store)
                out.extend(getattr(s, "pool_stores", ()))
            else:
                out.append(s)
        seen, unique = set(), []
        for s in out:
            if id(s) not in seen:
                seen.add(id(s))
                unique.append(s)
        return unique

    def _chains(self) -> list[Any]:
        """The TieredStores attached (directly, through the controller, or inside an SGLang backend)."""
        cands = [self.controller.store] if self.controller is not None else []
        out: list[Any] = []
        for s in [*cands, *self.stores]:
            chain = s if hasattr(s, "tiers") and hasattr(s, "first") else getattr(s, "tiers", None)
            if chain is not None and hasattr(chain, "first") and all(chain is not c for c in out):
                out.append(chain)
        return out

    def _tier_families(self, core: Any) -> Iterator[Any]:
        """Per tier of each chain: pages by event, errors, bytes; the cluster tier's integrity counters."""
        p = self.prefix
        pages = core.CounterMetricFamily(f"{p}_tier_pages", "pages per tier of a TieredStore, by event (hit, miss, "
                                         "fill: written after a later tier served it, write, write_failure)",
                                         labels=["tier", "event"])
        errors = core.CounterMetricFamily(f"{p}_tier_errors", "calls into a tier that raised (counted as misses or "
                                          "failed writes)", labels=["tier"])
        nbytes = core.CounterMetricFamily(f"{p}_tier_bytes", "bytes per tier, by direction (in: served, out: "
                                          "written)", labels=["tier", "direction"])
        integrity = core.CounterMetricFamily(f"{p}_cluster_pages", "the cluster tier's own page counters (corrupt, "
                                             "stale, unverified_served, unverified_skipped, ...)", labels=["event"])
        for chain in self._chains():
            try:
                stats = chain.get_stats()
            except Exception:  # noqa: BLE001 - a closed chain must not fail the scrape
                continue
            for tier, st in stats.items():
                for key, event in (("hits", "hit"), ("misses", "miss"), ("fills", "fill"), ("writes", "write"),
                                   ("write_failures", "write_failure")):
                    pages.add_metric([tier, event], float(st.get(key, 0)))
                errors.add_metric([tier], float(st.get("errors", 0)))
                nbytes.add_metric([tier, "in"], float(st.get("bytes_in", 0)))
                nbytes.add_metric([tier, "out"], float(st.get("bytes_out", 0)))
                own = st.get("store", {})
                if "unverified_served" in own:
                    for key in ("corrupt", "stale", "unverified_served", "unverified_skipped", "put_failures"):
                        integrity.add_metric([key], float(own.get(key, 0)))
        yield from (pages, errors, nbytes, integrity)

    def _planner_families(self, core: Any) -> Iterator[Any]:
        """Every restore decision (the controller's and SGLang backends'): plans by kind, tokens by source,
        predicted against observed time to first token; each tier's measured read and write GB/s."""
        p = self.prefix
        plans = core.CounterMetricFamily(f"{p}_restore_plans", "restore decisions, by kind (recompute, host, load, "
                                         "split)", labels=["planner", "kind"])
        tokens = core.CounterMetricFamily(f"{p}_restore_tokens", "prompt tokens of planned restores, by where their "
                                          "KV came from (a tier, or recomputed)", labels=["planner", "source"])
        timing = core.CounterMetricFamily(f"{p}_restore_ttft_seconds", "time to first token of the planned restores "
                                          "the engine timed, summed: predicted and observed", labels=["planner", "which"])
        declined = core.CounterMetricFamily(f"{p}_restore_declined_tokens", "prompt tokens some tier held that the "
                                            "chosen plans computed again (reading them was predicted slower)",
                                            labels=["planner"])
        slow = core.CounterMetricFamily(f"{p}_restore_slow_plans", "planned restores whose time to first token came "
                                        "out more than 10% over the prediction, by kind", labels=["planner", "kind"])
        rates = core.GaugeMetricFamily(f"{p}_tier_measured_gbps", "each tier's moving estimate of itself (GB/s)",
                                       labels=["planner", "tier", "direction"])
        # (one label value per planner: the controller's, and each SGLang backend's by its position in `stores`)
        sources: list[tuple[str, Any, Any]] = []
        if self.controller is not None:
            sources.append(("controller", self.controller.planner_stats, self.controller.measured))
        for i, s in enumerate(self.stores):
            planner = getattr(s, "planner", None)
            if planner is not None and hasattr(planner, "stats"):
                sources.append((f"store{i}", planner.stats, getattr(s, "measured", None)))
        if not sources:
            return
        for who, stats, measured in sources:
            d = stats.as_dict()
            for kind, n in d["plans"].items():
                plans.add_metric([who, kind], float(n))
            for tier, n in d["tokens_loaded"].items():
                tokens.add_metric([who, tier], float(n))
            tokens.add_metric([who, "recomputed"], float(d["tokens_recomputed"]))
            declined.add_metric([who], float(d["declined_tokens"]))
            timing.add_metric([who, "predicted"], float(d["predicted_s"]))
            timing.add_metric([who, "observed"], float(d["observed_s"]))
            for kind, n in d["slow_plans"].items():
                slow.add_metric([who, kind], float(n))
            try:
                estimates = measured() if measured is not None else {}
            except Exception:  # noqa: BLE001 - a closed store must not fail the scrape
                estimates = {}
            for name, est in estimates.items():
                rates.add_metric([who, name, "read"], float(est.read_GBps))
                rates.add_metric([who, name, "write"], float(est.write_GBps))
        yield from (plans, tokens, declined, timing, slow, rates)

    def _deadline_sources(self) -> list[tuple[dict[str, str], dict[str, Any]]]:
        """The controller's store calls (no label) and each engine backend's, labelled by its position in
        ``stores`` as its planner is."""
        out: list[tuple[dict[str, str], dict[str, Any]]] = []
        if self.controller is not None:
            out.append(({}, self.controller.deadline_stats()))
        for i, s in enumerate(self.stores):
            staged = getattr(s, "staged", None)
            if hasattr(s, "kvtier_stats") and staged is not None:
                try:
                    out.append(({"backend": f"store{i}"}, staged.stats()))
                except Exception:  # noqa: BLE001 - a closed backend must not fail the scrape
                    continue
        return out

    def describe(self) -> list[Any]:
        return []  # unchecked collector: metric families depend on what is attached at scrape time

    def collect(self) -> Iterator[Any]:
        core = require_prometheus()
        p = self.prefix
        counters = {key: core.CounterMetricFamily(f"{p}_store_{name}", doc, labels=["store"])
                    for key, name, doc in _STORE_COUNTERS}
        gauges = {key: core.GaugeMetricFamily(f"{p}_store_{name}", doc, labels=["store"])
                  for key, name, doc in _STORE_GAUGES}
        latency = core.HistogramMetricFamily(f"{p}_store_batch_seconds", "duration of one store batch (write: until "
                                             "durable; read: until verified)", labels=["store", "op"])
        for st in self._page_stores():
            stats = _store_stats(st)
            if stats is None:
                continue
            label = [os.path.basename(str(stats.get("dir", ""))) or "?"]
            for key, fam in counters.items():
                fam.add_metric(label, float(stats.get(key, 0) or 0))
            for key, fam in gauges.items():
                fam.add_metric(label, float(stats.get(key, 0) or 0))
            for op, hist in getattr(st, "latency", {}).items():
                buckets, total, _ = hist.snapshot()
                latency.add_metric([label[0], op], buckets, total)
        yield from counters.values()
        yield from gauges.values()
        yield latency
        yield from self._tier_families(core)
        yield from self._planner_families(core)
        yield from _deadline_families(core, p, self._deadline_sources())
        c = self.controller
        if c is None:
            return
        s = c.stats
        lookups = core.CounterMetricFamily(f"{p}_tier_lookup_pages", "pages looked up by TierController.match, by "
                                           "the tier that holds them (host, disk) or miss", labels=["tier"])
        for tier, n in (("host", s.host_hit_pages), ("disk", s.store_hit_pages), ("miss", s.miss_pages)):
            lookups.add_metric([tier], float(n))
        yield lookups
        pages = core.CounterMetricFamily(f"{p}_controller_pages", "pages moved by TierController, by path",
                                         labels=["path"])
        for attr, path in _CONTROLLER_PAGES:
            pages.add_metric([path], float(getattr(s, attr)))
        yield pages
        nbytes = core.CounterMetricFamily(f"{p}_controller_bytes", "bytes moved by TierController, by path",
                                          labels=["path"])
        for attr, path in _CONTROLLER_BYTES:
            nbytes.add_metric([path], float(getattr(s, attr)))
        yield nbytes
        for attr, doc in (("store_write_failures", "pages whose write to the store failed (they stay on the host)"),
                          ("prefetch_misses", "pages a prefetch did not find or could not read (recomputed)"),
                          ("host_evictions", "host pages evicted to make room"),
                          ("store_writes_given_up", "pages whose store write was given up before it started "
                           "(its deadline passed, or the store was out of use)"),
                          ("spills_given_up", "write-back evictions whose spill was skipped or missed its deadline")):
            fam = core.CounterMetricFamily(f"{p}_controller_{attr}", doc)
            fam.add_metric([], float(getattr(s, attr)))
            yield fam


def _deadline_families(core: Any, p: str, sources: list[tuple[dict[str, str], dict[str, Any]]]) -> Iterator[Any]:
    """The store's calls against their deadlines: the controller's (:meth:`kvtier.TierController.deadline_stats`,
    unlabelled) and each engine backend's (``backend="store<i>"``: ``kvtier_stats()["deadlines"]``)."""
    if not sources:
        return
    for name, doc in (("calls", "store calls sent or skipped, by kind"),
                      ("deadline_misses", "store calls answered at their deadline instead of by the store, by kind"),
                      ("skipped", "store calls not sent because the store was out of use (breaker open), by kind")):
        fam = core.CounterMetricFamily(f"{p}_store_{name}", doc, labels=["kind"])
        for labels, d in sources:
            for kind, n in d[name].items():
                fam.add_sample(f"{p}_store_{name}_total", {**labels, "kind": kind}, float(n))
        yield fam
    state = {"closed": 0.0, "half_open": 0.5, "open": 1.0}
    for name, doc, value in (
            ("fenced_pages", "host pages held by store calls past their deadline that have not returned",
             lambda d: d["fenced_pages"]),
            ("stuck_calls", "store calls past their deadline that have not returned", lambda d: d["stuck_calls"]),
            ("breaker_open", "1 while the store is out of use after missed deadlines (0.5 while a probing call is "
             "let through)", lambda d: state[d["breaker"]])):
        g = core.GaugeMetricFamily(f"{p}_store_{name}", doc)
        for labels, d in sources:
            g.add_sample(f"{p}_store_{name}", labels, float(value(d)))
        yield g
    trips = core.CounterMetricFamily(f"{p}_store_breaker_trips", "times the store was taken out of use")
    for labels, d in sources:
        trips.add_sample(f"{p}_store_breaker_trips_total", labels, float(d["breaker_trips"]))
    yield trips


def _store_stats(store: Any) -> dict[str, Any] | None:
    """A store's counters, or None while it cannot report (closed, or a reader whose writer has not started)."""
    try:
        if hasattr(store, "get_stats"):
            return dict(store.get_stats())
        native = store.native_store()  # a v2 pool store
        return dict(native.stats()) if native is not None else None
    except Exception:  # noqa: BLE001 - a scrape must not fail because one store is closed
        return None
