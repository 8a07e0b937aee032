"""Prometheus metrics (kvtier.metrics) as an operator scrapes them: per-tier lookups, bytes per path, batch
latency histograms, write failures and corrupt reads, through prometheus-client's own registry and parser."""

import errno
import os

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtier import DeviceKVPool, PageStore, TierController, host_pool_for, page_hashes, testing
from kvtier.metrics import KvtierCollector, LatencyHistogram

PS = 4


def scrape(collector):
    reg = CollectorRegistry()
    reg.register(collector)
    out = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples, name, **labels):
    hits = [v for (n, ls), v in samples.items() if n == name and all(dict(ls).get(k) == x for k, x in labels.items())]
    assert len(hits) == 1, (name, labels, [k for k in samples if k[0] == name])
    return hits[0]


def setup(tmp_path):
    dp = DeviceKVPool(16 * PS, PS, 2, 2, 8, 6, torch.float32, "cpu")
    for t in dp.k_buffer + dp.v_buffer:
        t.copy_(torch.randn_like(t))
    hp = host_pool_for(dp, layout="page_first_direct", host_to_device_ratio=1.0)
    st = PageStore(tmp_path, capacity_bytes=1 << 26)
    st.register_mem_pool_host(hp)
    return dp, hp, st, TierController(dp, hp, st, write_policy="write_through")


def test_controller_and_store_metrics(tmp_path):
    dp, hp, st, c = setup(tmp_path)
    col = KvtierCollector(controller=c)
    keys = page_hashes(list(range(3 * PS)), PS)
    rows = torch.arange(PS, 4 * PS)
    c.backup(rows, keys)
    c.wait_idle()
    assert c.match(keys + page_hashes(list(range(100, 100 + PS)), PS)) == (3, 0)
    s = scrape(col)
    store = os.path.basename(st.get_stats()["dir"])
    assert value(s, "kvtier_tier_lookup_pages_total", tier="host") == 3
    assert value(s, "kvtier_tier_lookup_pages_total", tier="miss") == 1
    assert value(s, "kvtier_controller_pages_total", path="backup") == 3
    assert value(s, "kvtier_controller_bytes_total", path="host_to_disk") == 3 * c.page_bytes
    assert value(s, "kvtier_store_objects", store=store) == 6  # K and V
    from kvtier.planner import PrefillModel, plan_restore

    slow = plan_restore(prompt_tokens=8 * PS, page_tokens=PS, page_bytes=c.page_bytes, host_pages=3,
                        prefill=PrefillModel.fixed(1e4))
    c.observe_ttft(slow, slow.predicted_s * 2)  # twice its prediction: a slow plan
    assert value(scrape(col), "kvtier_restore_slow_plans_total", planner="controller", kind=slow.kind) == 1
    assert value(s, "kvtier_store_written_bytes_total", store=store) == 3 * c.page_bytes
    assert value(s, "kvtier_store_batch_seconds_count", store=store, op="write") == 1
    assert value(s, "kvtier_store_batch_seconds_bucket", store=store, op="write", le="+Inf") == 1
    # a failing disk read: a counted failure and a miss, visible to the scrape
    with testing.faults("data_read", "error", errno=errno.EIO, times=None):
        assert st.batch_get_v1(keys[:1], torch.arange(8 * PS, 9 * PS)) == [False]
    s = scrape(col)
    assert value(s, "kvtier_store_read_failures_total", store=store) >= 1
    assert value(s, "kvtier_store_batch_seconds_count", store=store, op="read") == 1
    # a corrupt object on disk: counted as a corrupt read
    st.close()
    data = [f for f in os.listdir(os.path.join(tmp_path, store)) if f.endswith(".dat")]
    path = os.path.join(tmp_path, store, data[0])
    with open(path, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    st2 = PageStore(tmp_path, capacity_bytes=1 << 26)
    st2.register_mem_pool_host(hp)
    got = st2.batch_get_v1(keys, torch.arange(8 * PS, 11 * PS))
    assert got.count(False) == 1
    s = scrape(KvtierCollector(stores=[st2]))
    assert value(s, "kvtier_store_corrupt_reads_total", store=store) == 1
    c.close()
    st2.close()
    scrape(KvtierCollector(stores=[st2]))  # a closed store does not break the scrape


def test_sglang_backend_is_collected(tmp_path):
    from sglang_pools import config, idx, sglang_pool

    from kvtier.integrations.sglang import KvtierStorage

    be = KvtierStorage(config(tmp_path))
    be.register_mem_pool_host(sglang_pool("page_first_direct"))
    assert be.batch_set_v1(["a" * 64, "b" * 64], idx([0, 1])) == [True, True]
    s = scrape(KvtierCollector(stores=[be]))
    assert value(s, "kvtier_store_objects") == 4
    be.close()


def test_latency_histogram_is_cumulative():
    h = LatencyHistogram((0.1, 1.0))
    for x in (0.05, 0.1, 0.5, 3.0):
        h.observe(x)
    buckets, total, count = h.snapshot()
    assert buckets == [("0.1", 2), ("1.0", 3), ("+Inf", 4)] and count == 4 and total == pytest.approx(3.65)


def test_declined_tokens_are_exported(tmp_path):
    """Cached tokens a plan computed again (the tier was predicted slower than recomputing) are a counter."""
    from kvtier.planner import PrefillModel, TierEstimate, plan_restore

    dp, hp, st, c = setup(tmp_path)
    try:
        slow_disk = {"disk": TierEstimate("disk", read_GBps=1e-4, read_latency_s=0.0, source="probe")}
        p = plan_restore(prompt_tokens=8 * PS + 1, page_tokens=PS, page_bytes=c.page_bytes, host_pages=2,
                         store_segments=[("disk", 6)], tiers=slow_disk, prefill=PrefillModel.fixed(1e4))
        assert p.kind == "host" and p.reused_pages == 2  # the host's pages reused, the disk's 6 declined
        c.planner_stats.record(p)
        col = KvtierCollector(controller=c)
        assert value(scrape(col), "kvtier_restore_declined_tokens_total", planner="controller") == 6 * PS
    finally:
        c.close()
        st.close()


class _ToyTier:
    """A tier of a caller's own behind the disk (what docs/ARCHITECTURE.md's recipe for a new tier builds):
    it keeps nothing and reports one family of its own."""

    name = "toy"

    def __init__(self, pool):
        self.pool, self.page_bytes, self.sets = pool, 0, 0

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        self.sets += len(keys)
        return [True] * len(keys)

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        return [False] * len(keys)

    def batch_exists(self, keys, extra_info=None):
        return 0

    def get_stats(self):
        return {"sets": self.sets}

    def close(self):
        pass

    def report_metrics(self, scrape, name):
        scrape.counter("toy_pages", "pages the toy tier was given", ["op"]).add_metric(["set"], float(self.sets))
        return ()


class _Quiet(_ToyTier):
    """A tier that reports nothing of its own (``report_metrics = None``: not a MetricsSource)."""

    name = "quiet"
    report_metrics = None


def test_a_new_tier_reports_its_own_families(tmp_path):
    from kvtier.tiers import TieredStore

    dp, hp, st, c = setup(tmp_path)
    try:
        toy, quiet = _ToyTier(hp), _Quiet(hp)
        chain = TieredStore([("disk", st), ("toy", toy), ("quiet", quiet)])
        keys = page_hashes(list(range(2 * PS)), PS)
        assert chain.batch_set_v1(keys, torch.arange(PS, 3 * PS)) == [True, True]
        s = scrape(KvtierCollector(stores=[chain, st, toy]))  # each object once, however many name it
        assert value(s, "kvtier_toy_pages_total", op="set") == 2
        assert value(s, "kvtier_tier_pages_total", tier="toy", event="write") == 2
        assert value(s, "kvtier_tier_pages_total", tier="quiet", event="write") == 2  # the chain's view of it
        assert value(s, "kvtier_store_objects") == 4  # the disk tier's own
    finally:
        c.close()
        st.close()


def test_an_object_that_reports_no_metrics_is_refused(tmp_path):
    from kvtier import InvalidArgumentError
    from kvtier.metrics_server import MetricsEndpoint
    from kvtier.staging import StagedDisk

    dp, hp, st, c = setup(tmp_path)
    try:
        with pytest.raises(InvalidArgumentError, match=r"`stores\[1\]`: TierController reports no metrics"):
            KvtierCollector(stores=[st, c])
        with pytest.raises(InvalidArgumentError, match="`stores`"):
            KvtierCollector(stores="disk")
        with pytest.raises(InvalidArgumentError, match="`controller`: a kvtier.TierController, got PageStore"):
            KvtierCollector(controller=st)
        with pytest.raises(InvalidArgumentError, match="`source`: object reports no metrics"):
            MetricsEndpoint.claim(None).attach(object())
        # a store seen through its staging view is reported once, as itself
        s = scrape(KvtierCollector(stores=[StagedDisk(st, None), st]))
        assert len([k for k in s if k[0] == "kvtier_store_objects"]) == 1
    finally:
        c.close()
        st.close()


@pytest.mark.parametrize("where", ["kvtier.store:PageStore", "kvtier.tiers.chain:TieredStore",
                                   "kvtier.tiers.mooncake:MooncakeTier", "kvtier.staging:StagedDisk",
                                   "kvtier.integrations._pools_v2:PoolStore", "kvtier.integrations.sglang:KvtierStorage",
                                   "kvtier.integrations.vllm:KvtierTier"])
def test_every_tier_and_engine_backend_reports_its_metrics(where):
    """Checked on the classes, without opening anything: each one is a MetricsSource, with its parameters."""
    import importlib
    import inspect

    from kvtier.metrics import MetricsSource

    module, name = where.split(":")
    if module.startswith("kvtier.integrations."):
        pytest.importorskip(module.rsplit(".", 1)[1].lstrip("_").replace("pools_v2", "sglang"))
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, MetricsSource)
    params = [p.name for p in inspect.signature(cls.report_metrics).parameters.values()]
    assert params == ["self", "scrape", "name"]
