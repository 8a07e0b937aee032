"""Prometheus metrics for operators: per-tier hits and misses, bytes per path, batch latency histograms, write
failures, corrupt reads and dropped journal records, for a :class:`~kvtier.TierController` and any number of
page stores, chains of tiers, cluster tiers and engine backends (SGLang's
:class:`~kvtier.integrations.sglang.KvtierStorage`, vLLM's ``KvtierTier``).

    from prometheus_client import start_http_server, REGISTRY
    from kvtier.metrics import KvtierCollector

    REGISTRY.register(KvtierCollector(controller=ctrl, stores=[store]))
    start_http_server(9400)          # scrape http://host:9400/metrics

Needs ``prometheus-client`` (``pip install 'kvtier[metrics]'``); the collector reads the objects' counters on
each scrape (nothing is sampled in between), so it costs nothing while nobody scrapes. Latency histograms
(:class:`LatencyHistogram`) are kept by the objects themselves whether or not this module is used.

Each object reports its own families (:class:`MetricsSource`, one method): at a scrape the collector asks
every object it was given, and every object those name in turn (a chain its tiers, an engine backend its
page stores), to add its samples to the scrape's families (:class:`Scrape`).
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from ._errors import InvalidArgumentError

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


@runtime_checkable
class MetricsSource(Protocol):
    """What :class:`KvtierCollector` exports: an object that adds its own samples to a scrape and names the
    objects inside it that report theirs. :class:`~kvtier.PageStore`, :class:`~kvtier.tiers.TieredStore`,
    :class:`~kvtier.tiers.mooncake.MooncakeTier`, SGLang's ``KvtierStorage`` and vLLM's ``KvtierTier``
    implement it; a new tier adds its metrics with this one method."""

    def report_metrics(self, scrape: Scrape, name: str) -> Iterable[MetricsSource]:
        """Add this object's samples to ``scrape`` and return the objects inside it that report their own (a
        chain its tiers, an engine backend its page stores). Each object is reported once per scrape, however
        many sources name it. ``name``: the label of the source the collector reached this object through
        (``controller``, or ``store<i>``: its position in ``stores``), which the planner and deadline families
        of an engine backend carry."""
        ...


class Scrape:
    """The families of one scrape, which the sources fill (:class:`MetricsSource`): each family is exported
    once, with the samples of every source in the order the collector reached them; families a tier adds of
    its own (:meth:`counter`, :meth:`gauge`) come after kvtier's."""

    def __init__(self, core: Any, prefix: str) -> None:
        self.core, self.prefix = core, prefix
        p = prefix
        self._counters = {key: core.CounterMetricFamily(f"{p}_store_{name}", doc, labels=["store"])
                          for key, name, doc in _STORE_COUNTERS}
        self._gauges = {key: core.GaugeMetricFamily(f"{p}_store_{name}", doc, labels=["store"])
                        for key, name, doc in _STORE_GAUGES}
        self._latency = core.HistogramMetricFamily(f"{p}_store_batch_seconds", "duration of one store batch (write: "
                                                   "until durable; read: until verified)", labels=["store", "op"])
        self._stores: set[str] = set()
        self._pages = core.CounterMetricFamily(f"{p}_tier_pages", "pages per tier of a TieredStore, by event (hit, "
                                               "miss, fill: written after a later tier served it, write, "
                                               "write_failure)", labels=["tier", "event"])
        self._errors = core.CounterMetricFamily(f"{p}_tier_errors", "calls into a tier that raised (counted as "
                                                "misses or failed writes)", labels=["tier"])
        self._bytes = core.CounterMetricFamily(f"{p}_tier_bytes", "bytes per tier, by direction (in: served, out: "
                                               "written)", labels=["tier", "direction"])
        self._integrity = core.CounterMetricFamily(f"{p}_cluster_pages", "the cluster tier's own page counters "
                                                   "(corrupt, stale, unverified_served, unverified_skipped, ...)",
                                                   labels=["event"])
        self._planners: list[tuple[str, Mapping[str, Any], Callable[[], Mapping[str, Any]] | None]] = []
        self._deadlines: list[tuple[dict[str, str], Mapping[str, Any]]] = []
        self._own: dict[str, Any] = {}

    def page_store(self, stats: Callable[[], Mapping[str, Any] | None],
                   latency: Mapping[str, LatencyHistogram]) -> None:
        """A page-store namespace: its counters and gauges (:meth:`kvtier.PageStore.get_stats`) and batch
        latencies, labelled ``store`` by its directory's name. ``stats`` is called now; a store whose
        ``stats`` raises or gives None (closed, or a reader whose writer has not started) is left out of this
        scrape, and so is a second store of a name already reported (a later disk tier of a chain over the same
        host pool: its series would repeat the first's, which Prometheus refuses)."""
        try:
            got = stats()
        except Exception:  # noqa: BLE001 - a scrape must not fail because one store is closed
            return
        if got is None:
            return
        label = [os.path.basename(str(got.get("dir", ""))) or "?"]
        if label[0] in self._stores:
            return
        self._stores.add(label[0])
        for key, fam in self._counters.items():
            fam.add_metric(label, float(got.get(key, 0) or 0))
        for key, fam in self._gauges.items():
            fam.add_metric(label, float(got.get(key, 0) or 0))
        for op, hist in latency.items():
            buckets, total, _ = hist.snapshot()
            self._latency.add_metric([label[0], op], buckets, total)

    def chain(self, stats: Callable[[], Mapping[str, Mapping[str, Any]]]) -> None:
        """A chain's view of each of its tiers (:meth:`kvtier.tiers.TieredStore.get_stats`): pages by event,
        errors, bytes; nothing when ``stats`` raises (a closed chain)."""
        try:
            got = stats()
        except Exception:  # noqa: BLE001 - a closed chain must not fail the scrape
            return
        for tier, st in got.items():
            for key, event in (("hits", "hit"), ("misses", "miss"), ("fills", "fill"), ("writes", "write"),
                               ("write_failures", "write_failure")):
                self._pages.add_metric([tier, event], float(st.get(key, 0)))
            self._errors.add_metric([tier], float(st.get("errors", 0)))
            self._bytes.add_metric([tier, "in"], float(st.get("bytes_in", 0)))
            self._bytes.add_metric([tier, "out"], float(st.get("bytes_out", 0)))

    def cluster_pages(self, stats: Mapping[str, Any]) -> None:
        """The cluster tier's integrity counters (:meth:`kvtier.tiers.mooncake.MooncakeTier.get_stats`)."""
        for key in ("corrupt", "stale", "unverified_served", "unverified_skipped", "put_failures"):
            self._integrity.add_metric([key], float(stats.get(key, 0)))

    def planner(self, who: str, stats: Mapping[str, Any],
                measured: Callable[[], Mapping[str, Any]] | None = None) -> None:
        """One planner's restore decisions (``PlannerStats.as_dict()``), labelled ``planner=who``, and the
        estimates ``measured`` returns (each tier's read and write GB/s; none when it raises)."""
        self._planners.append((who, stats, measured))

    def deadlines(self, labels: dict[str, str], stats: Callable[[], Mapping[str, Any]]) -> None:
        """One caller's store calls against their deadlines (``StagedIO.stats()``, or the controller's
        ``deadline_stats()``), with ``labels``; nothing when ``stats`` raises (a closed backend)."""
        try:
            self._deadlines.append((labels, stats()))
        except Exception:  # noqa: BLE001 - a closed backend must not fail the scrape
            pass

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Any:
        """The counter family ``<prefix>_<name>`` of a tier's own (a ``prometheus_client``
        ``CounterMetricFamily``: ``.add_metric(label values, value)``), made at its first use in this scrape."""
        return self._family(self.core.CounterMetricFamily, name, doc, labels)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Any:
        """As :meth:`counter`, a gauge family."""
        return self._family(self.core.GaugeMetricFamily, name, doc, labels)

    def _family(self, kind: Any, name: str, doc: str, labels: Sequence[str]) -> Any:
        fam = self._own.get(name)
        if fam is None:
            fam = self._own[name] = kind(f"{self.prefix}_{name}", doc, labels=list(labels))
        return fam

    def families(self) -> Iterator[Any]:
        """Every family, in the order the exposition keeps (the controller's own come after, from the
        collector)."""
        yield from self._counters.values()
        yield from self._gauges.values()
        yield self._latency
        yield from (self._pages, self._errors, self._bytes, self._integrity)
        yield from _planner_families(self.core, self.prefix, self._planners)
        yield from _deadline_families(self.core, self.prefix, self._deadlines)
        yield from self._own.values()


@runtime_checkable
class _Controller(Protocol):
    """What the collector reads of a :class:`~kvtier.TierController` (``controller=``)."""

    store: Any
    stats: Any
    planner_stats: Any

    def measured(self) -> Any: ...

    def deadline_stats(self) -> Any: ...


class KvtierCollector:
    """A Prometheus collector (``REGISTRY.register(KvtierCollector(...))``) over live kvtier objects.

    Args:
        controller: a :class:`~kvtier.TierController` (its store is included).
        stores: further objects that report metrics (:class:`MetricsSource`): :class:`~kvtier.PageStore` s,
            :class:`~kvtier.tiers.TieredStore` s, :class:`~kvtier.tiers.mooncake.MooncakeTier` s, and the engine
            backends (SGLang's ``KvtierStorage``, whose extra v2 pools and cluster tier are included, and vLLM's
            ``KvtierTier``). Anything else is an :class:`~kvtier.InvalidArgumentError` naming its position.
        prefix: metric name prefix (default ``kvtier``).
    """

    def __init__(self, *, controller: Any = None, stores: Sequence[Any] = (), prefix: str = "kvtier") -> None:
        require_prometheus()  # fail at construction, not at the first scrape
        if controller is not None and not isinstance(controller, _Controller):
            raise InvalidArgumentError(f"invalid argument `controller`: a kvtier.TierController, got "
                                       f"{type(controller).__name__}")
        if isinstance(stores, (str, bytes)) or not isinstance(stores, Iterable):
            raise InvalidArgumentError(f"invalid argument `stores`: a list of objects that report metrics, got "
                                       f"{type(stores).__name__}")
        self.stores = list(stores)
        for i, s in enumerate(self.stores):
            check_source(s, f"stores[{i}]")
        self.controller = controller
        self.prefix = prefix

    def describe(self) -> list[Any]:
        return []  # unchecked collector: metric families depend on what is attached at scrape time

    def collect(self) -> Iterator[Any]:
        scrape = Scrape(require_prometheus(), self.prefix)
        c = self.controller
        roots: list[tuple[str, Any]] = []
        if c is not None:
            scrape.planner("controller", c.planner_stats.as_dict(), c.measured)
            scrape.deadlines({}, c.deadline_stats)
            if isinstance(c.store, MetricsSource):  # (a tier of the caller's own may report nothing)
                roots.append(("controller", c.store))
        roots += [(f"store{i}", s) for i, s in enumerate(self.stores)]
        seen: set[int] = set()

        def visit(source: MetricsSource, name: str) -> None:
            if id(source) in seen:
                return
            seen.add(id(source))
            for inner in source.report_metrics(scrape, name):
                visit(inner, name)

        for name, source in roots:
            visit(source, name)
        yield from scrape.families()
        if c is not None:
            yield from _controller_families(scrape.core, self.prefix, c.stats)


def check_source(source: Any, argument: str) -> None:
    """Raises :class:`~kvtier.InvalidArgumentError` naming ``argument`` unless ``source`` reports metrics
    (:class:`MetricsSource`)."""
    if not isinstance(source, MetricsSource):
        raise InvalidArgumentError(
            f"invalid argument `{argument}`: {type(source).__name__} reports no metrics (it has no "
            "report_metrics, kvtier.metrics.MetricsSource); pass PageStores, TieredStores, MooncakeTiers or "
            "engine backends (SGLang's KvtierStorage, vLLM's KvtierTier), and a TierController as `controller`")


def _planner_families(core: Any, p: str, sources: list[tuple[str, Mapping[str, Any], Any]]) -> Iterator[Any]:
    """Every restore decision (the controller's and the engine backends'): plans by kind, tokens by source,
    predicted against observed time to first token; each tier's measured read and write GB/s. One label value
    per planner: ``controller``, and each backend's ``store<i>``."""
    if not sources:
        return
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
    for who, d, measured in sources:
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


def _controller_families(core: Any, p: str, s: Any) -> Iterator[Any]:
    """The controller's own counters (:class:`kvtier.TierController`'s ``stats``)."""
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


def _deadline_families(core: Any, p: str, sources: list[tuple[dict[str, str], Mapping[str, Any]]]) -> Iterator[Any]:
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
