"""The engine backends' ``metrics_port``: kvtier's Prometheus families served on an HTTP endpoint of the engine
process (kvtier.metrics_server), scraped over loopback the way Prometheus does, from SGLang's KvtierStorage
and vLLM's KvtierTier built on the CPU as their conformance tests build them (the real sglang and vllm
packages). Every server is stopped by the test that started it; nothing listens beyond 127.0.0.1."""

import dataclasses
import os
import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sglang_pools import config, idx, sglang_pool
from vllm.v1.kv_offload.base import LookupResult
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm_tier import keys, load, offloading_config, random_rows, shutdown, store

import kvtier
from kvtier.integrations.sglang import KvtierStorage
from kvtier.metrics_server import MetricsEndpoint

TIMEOUT = 10  # seconds for any one HTTP request (a hang guard: a scrape over loopback takes milliseconds)
#: The backends' deadlines here: a hang guard, not the defaults (2 s) a loaded machine could make a batch miss
#: (these tests count hits, puts and deadline misses, and a batch past its deadline is a miss)
GUARD = {"read_deadline_s": 60.0, "write_deadline_s": 60.0}


def get(url, accept=None):
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
        return r.status, r.headers.get("Content-Type"), r.read().decode()


def scrape(url):
    status, content_type, text = get(url)
    assert status == 200 and content_type.startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples, name, **labels):
    hits = [v for (n, ls), v in samples.items() if n == name and all(dict(ls).get(k) == x for k, x in labels.items())]
    assert len(hits) == 1, (name, labels, [k for k in samples if k[0] == name])
    return hits[0]


def stores(samples):
    """The store namespaces a scrape reports (its ``store`` labels)."""
    return {dict(ls)["store"] for (n, ls) in samples if n == "kvtier_store_objects"}


def refused(url):
    """Whether nothing serves ``url`` any more (its server was stopped)."""
    try:
        get(url)
    except urllib.error.URLError as e:
        return isinstance(e.reason, ConnectionRefusedError)
    except ConnectionResetError:  # (a server stopping while it answered: not gone yet)
        return False
    return False


def free_ports(n):
    """A port p with p .. p + n - 1 free on 127.0.0.1 now."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        socks = []
        try:
            for p in range(base, base + n):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no run of free ports")


@pytest.fixture
def sglang_backend():
    """SGLang backends on SGLang's own host pool (CPU), closed at the end whatever the test did."""
    made = []

    def make(path, **extra):
        be = KvtierStorage(config(path, **{**GUARD, **extra}))
        made.append(be)
        be.register_mem_pool_host(sglang_pool("page_first_direct"))
        return be

    yield make
    for be in made:
        be.close()


def namespace(be):
    return os.path.basename(be.store.get_stats()["dir"])


# ------------------------------------------------------------------------------------------------ SGLang
def test_sglang_backend_serves_its_families(tmp_path, sglang_backend):
    be = sglang_backend(tmp_path, metrics_port=0)
    url = be.metrics_endpoint.url
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics") and be.metrics_endpoint.port > 0
    ks = [f"{i:064x}" for i in range(3)]
    assert be.batch_set_v1(ks[:2], idx([0, 1])) == [True, True]
    assert be.batch_get_v1(ks, idx([4, 5, 6])) == [True, True, False]
    assert be.batch_exists(ks) == 2
    s = scrape(url)
    ns = namespace(be)
    assert stores(s) == {ns}
    # two pages written and read: a K and a V object each; the third key's two objects missed
    assert value(s, "kvtier_store_puts_total", store=ns) == 4
    assert value(s, "kvtier_store_hits_total", store=ns) == 4
    assert value(s, "kvtier_store_misses_total", store=ns) == 2
    assert value(s, "kvtier_store_objects", store=ns) == 4
    assert value(s, "kvtier_store_written_bytes_total", store=ns) == be.store.get_stats()["bytes_written"] > 0
    assert value(s, "kvtier_store_batch_seconds_count", store=ns, op="write") >= 1  # (a staged batch: pieces)
    assert value(s, "kvtier_store_corrupt_reads_total", store=ns) == 0
    # the deadline families operators alert on, for this backend's staged batches
    assert value(s, "kvtier_store_calls_total", backend="store0", kind="read") >= 1  # (pieces of the batch)
    assert value(s, "kvtier_store_calls_total", backend="store0", kind="write") >= 1
    assert value(s, "kvtier_store_deadline_misses_total", backend="store0", kind="read") == 0
    assert value(s, "kvtier_store_breaker_open", backend="store0") == 0
    assert value(s, "kvtier_store_fenced_pages", backend="store0") == 0
    # what Prometheus negotiates, and nothing but /metrics
    status, content_type, text = get(url, accept="application/openmetrics-text; version=1.0.0")
    assert status == 200 and content_type.startswith("application/openmetrics-text") and text.endswith("# EOF\n")
    with pytest.raises(urllib.error.HTTPError) as e:
        get(url.removesuffix("/metrics") + "/other")
    assert e.value.code == 404
    e.value.close()
    be.close()
    assert refused(url) and be.metrics_endpoint.url is None
    be.close()  # idempotent


def test_sglang_backends_of_one_process_share_the_port(tmp_path, sglang_backend):
    a = sglang_backend(tmp_path / "a", metrics_port=0, tp_rank=0, tp_size=2)
    b = sglang_backend(tmp_path / "b", metrics_port=0, tp_rank=1, tp_size=2)
    url = a.metrics_endpoint.url
    assert b.metrics_endpoint.url == url  # `metrics_port: 0` twice: the port the first one picked
    assert a.batch_set_v1(["a" * 64], idx([0])) == [True]
    assert b.batch_set_v1(["b" * 64, "c" * 64], idx([0, 1])) == [True, True]
    s = scrape(url)
    assert stores(s) == {namespace(a), namespace(b)}
    assert value(s, "kvtier_store_puts_total", store=namespace(a)) == 2
    assert value(s, "kvtier_store_puts_total", store=namespace(b)) == 4
    assert {dict(ls)["backend"] for (n, ls) in s if n == "kvtier_store_breaker_open"} == {"store0", "store1"}
    a.close()
    s = scrape(url)  # the other backend keeps the server
    assert stores(s) == {namespace(b)} and value(s, "kvtier_store_puts_total", store=namespace(b)) == 4
    b.close()
    assert refused(url)


def test_sglang_fixed_port_is_offset_by_rank(tmp_path, sglang_backend):
    port = free_ports(2)
    r0 = sglang_backend(tmp_path / "r0", metrics_port=port, tp_rank=0, tp_size=2)
    r1 = sglang_backend(tmp_path / "r1", metrics_port=port, tp_rank=1, tp_size=2)
    again = sglang_backend(tmp_path / "again", metrics_port=port, tp_rank=0, tp_size=2)  # rank 0 again: joins
    assert (r0.metrics_endpoint.port, r1.metrics_endpoint.port, again.metrics_endpoint.port) == (port, port + 1, port)
    assert stores(scrape(r0.metrics_endpoint.url)) == {namespace(r0), namespace(again)}
    assert stores(scrape(r1.metrics_endpoint.url)) == {namespace(r1)}
    urls = [r0.metrics_endpoint.url, r1.metrics_endpoint.url]
    for be in (r0, r1, again):
        be.close()
    assert all(refused(u) for u in urls)


# ------------------------------------------------------------------------------------------------ vLLM
def test_vllm_tier_serves_its_families(tmp_path, managers):
    m = managers(offloading_config(tmp_path, rows=4, metrics_port=0, **GUARD))
    tier = m.secondary_tiers[0]
    url = tier.metrics_endpoint.url
    first = keys(4)
    assert all(r.success for r in store(m, first, random_rows(m, 4, seed=1)))
    store(m, keys(4, start=200), random_rows(m, 4, seed=2))  # evicts `first` from vLLM's CPU tier
    got, res = load(m, first + keys(1, start=900))
    assert res == [LookupResult.HIT] * 4 + [LookupResult.MISS] and len(got) == 4
    s = scrape(url)
    ns = os.path.basename(tier.store.get_stats()["dir"])
    assert stores(s) == {ns}
    assert value(s, "kvtier_store_puts_total", store=ns) == 8  # one object per row
    assert value(s, "kvtier_store_hits_total", store=ns) == 4
    assert value(s, "kvtier_store_objects", store=ns) == 8
    assert value(s, "kvtier_store_read_bytes_total", store=ns) == 4 * tier.row_bytes
    assert value(s, "kvtier_store_calls_total", backend="store0", kind="read") >= 1
    assert value(s, "kvtier_store_breaker_open", backend="store0") == 0
    shutdown(m)  # vLLM shuts its tiers down: the endpoint goes with the tier
    assert refused(url) and tier.metrics_endpoint.url is None


def test_vllm_replicas_and_an_sglang_backend_in_one_process(tmp_path, sglang_backend, managers):
    """Fixed port: a DP replica serves on metrics_port + its index; an SGLang backend of the same process
    asking for the same port joins the server there (one per host and port, whatever the engine)."""
    port = free_ports(2)
    tiers = []
    for dp in range(2):
        cfg = offloading_config(tmp_path / "vllm", rows=4, metrics_port=port, **GUARD)
        par = dataclasses.replace(cfg.parallel, data_parallel_index=dp, data_parallel_size=2)
        m = managers(dataclasses.replace(cfg, parallel=par))
        store(m, keys(dp + 1), random_rows(m, dp + 1, seed=dp))
        tiers.append((m, m.secondary_tiers[0]))
    assert [t.metrics_endpoint.port for _, t in tiers] == [port, port + 1]
    be = sglang_backend(tmp_path / "sglang", metrics_port=port)
    assert be.metrics_endpoint.port == port
    ns = [os.path.basename(t.store.get_stats()["dir"]) for _, t in tiers]
    s0, s1 = scrape(tiers[0][1].metrics_endpoint.url), scrape(tiers[1][1].metrics_endpoint.url)
    assert stores(s0) == {ns[0], namespace(be)} and stores(s1) == {ns[1]}
    assert value(s0, "kvtier_store_puts_total", store=ns[0]) == 1 and value(s1, "kvtier_store_puts_total", store=ns[1]) == 2
    urls = [t.metrics_endpoint.url for _, t in tiers]
    for m, _ in tiers:
        shutdown(m)
    assert refused(urls[1]) and stores(scrape(urls[0])) == {namespace(be)}  # the SGLang backend keeps port
    be.close()
    assert refused(urls[0])


# ------------------------------------------------------------------------------------------------ refused
BAD = [({"metrics_port": -1}, "metrics_port"), ({"metrics_port": 65536}, "metrics_port"),
       ({"metrics_port": True}, "metrics_port"), ({"metrics_port": "9400"}, "metrics_port"),
       ({"metrics_port": 9400.0}, "metrics_port"), ({"metrics_port": 0, "metrics_host": ""}, "metrics_host"),
       ({"metrics_port": 0, "metrics_host": 127}, "metrics_host")]


@pytest.mark.parametrize("extra,name", BAD)
def test_bad_values_are_refused_by_name(tmp_path, extra, name):
    root = tmp_path / "store"
    with pytest.raises(kvtier.InvalidArgumentError, match=f"`{name}`"):
        KvtierStorage(config(root, **extra))
    assert not root.exists()  # checked before anything is opened
    cfg = offloading_config(root, **extra)
    with pytest.raises(kvtier.InvalidArgumentError, match=f"`{name}` \\(kvtier tier\\)") as e:
        OffloadingSpecFactory.create_spec(cfg).get_manager()
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value)
    assert not root.exists() and not os.path.exists(f"/dev/shm/vllm_offload_{cfg.engine_id}.mmap")


def test_port_plus_rank_past_65535_is_refused(tmp_path):
    with pytest.raises(kvtier.InvalidArgumentError, match="`metrics_port`: 65535 plus this process's rank index 1"):
        KvtierStorage(config(tmp_path / "store", metrics_port=65535, tp_rank=1, tp_size=2))
    assert not (tmp_path / "store").exists()


def test_busy_port_is_a_clear_error_before_anything_opens(tmp_path, sglang_backend):
    root = tmp_path / "store"
    with socket.socket() as other:  # someone else's server on the port
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(kvtier.KvtierError, match=f"`metrics_port` {port}: .*127.0.0.1:{port}.*in use"):
            KvtierStorage(config(root, metrics_port=port))
        assert not root.exists()
        cfg = offloading_config(root, metrics_port=port)
        with pytest.raises(kvtier.KvtierError, match=f"`metrics_port` {port}"):
            OffloadingSpecFactory.create_spec(cfg).get_manager()
        assert not root.exists() and not os.path.exists(f"/dev/shm/vllm_offload_{cfg.engine_id}.mmap")
    be = sglang_backend(root, metrics_port=port)  # free again: a later backend gets it
    assert be.metrics_endpoint.port == port
    be.close()


def test_a_failed_construction_gives_the_port_back(tmp_path, sglang_backend):
    held = sglang_backend(tmp_path / "a", metrics_port=0)
    url = held.metrics_endpoint.url
    with pytest.raises(kvtier.KvtierError) as e:  # a keyring directory that is not there: opened after the port
        KvtierStorage(config(tmp_path / "b", metrics_port=0, keyring=str(tmp_path / "no-keyring")))
    assert "keyring" in str(e.value) or "no-keyring" in str(e.value)
    held.close()
    assert refused(url)  # the failed backend's lease was released: the last close stopped the server


def test_missing_prometheus_client_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "prometheus_client", None)
    with pytest.raises(kvtier.KvtierError, match=r"pip install 'kvtier\[metrics\]'"):
        KvtierStorage(config(tmp_path / "store", metrics_port=0))
    assert not (tmp_path / "store").exists()
    be = KvtierStorage(config(tmp_path / "store"))  # off (the default): no prometheus-client needed
    assert be.metrics_endpoint.url is None
    be.close()


def test_endpoint_without_an_engine(tmp_path, sglang_backend):
    """The library's own use: any PageStore on an endpoint of its own (here an SGLang backend's, whose own
    option is off)."""
    be = sglang_backend(tmp_path)
    assert be.metrics_endpoint.url is None and be.metrics_endpoint.port is None
    assert be.batch_set_v1(["a" * 64], idx([0])) == [True]
    off = MetricsEndpoint.claim(None)
    off.attach(be.store)
    assert off.url is None
    ep = MetricsEndpoint.claim(0)
    try:
        ep.attach(be.store)
        s = scrape(ep.url)
        assert stores(s) == {namespace(be)} and value(s, "kvtier_store_puts_total") == 2
        assert not any(n.startswith("kvtier_store_breaker") for (n, _) in s)  # a store alone: no deadline families
        url = ep.url
    finally:
        ep.close()
        off.close()
    assert refused(url)


def test_a_backend_dropped_without_close_is_not_kept_alive(tmp_path):
    """Serving a backend never keeps it (its store, its namespace lock, the port) alive: one the engine drops
    without close() is collected, leaves the scrape, and its lease, the last, stops the server."""
    import gc
    import time
    import weakref

    be = KvtierStorage(config(tmp_path, metrics_port=0))
    be.register_mem_pool_host(sglang_pool("page_first_direct"))
    url, alive = be.metrics_endpoint.url, weakref.ref(be)
    assert stores(scrape(url)) == {namespace(be)}
    del be
    gc.collect()
    assert alive() is None
    deadline = time.monotonic() + 120  # (the lease ends on a thread of its own; a guard against waiting forever,
    # not a bound on how fast: the assertion is that the port is given back at all)
    while not refused(url) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert refused(url)


@pytest.mark.timeout(60)
def test_a_forked_child_neither_serves_nor_holds_the_parents_port(tmp_path):
    """After fork the child has the parent's servers but not their threads: it closes its copies of their
    sockets (the parent's port is free again once the parent closes), its leases close at once, and it may
    claim a port of its own."""
    ep = MetricsEndpoint.claim(0)
    url, port = ep.url, ep.port
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's pytest machinery
        ok = 0
        try:
            ep.close()  # (the parent's server: returns at once)
            mine = MetricsEndpoint.claim(0)
            ok = int(mine.port is not None and mine.port != port)
            mine.close()
        finally:
            os.write(w, bytes([ok]))
            os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.waitpid(pid, 0)
    os.close(r)
    assert got == b"\x01"
    assert stores(scrape(url)) == set()  # the parent still serves
    ep.close()
    assert refused(url)
    again = MetricsEndpoint.claim(port)  # no child holds the port
    again.close()
