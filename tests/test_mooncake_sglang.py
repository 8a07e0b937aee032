"""Interoperability with SGLang's own Mooncake backend (the real ``sglang`` package, on CPU, against a real
Mooncake master and storage process): pages a stock SGLang node writes are kvtier's to read (only by explicit
option: they carry no checksum), and pages kvtier writes are hits for SGLang. Plus the SGLang backend's
``"tiers"`` configuration."""

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

from kvtier._errors import InvalidArgumentError
from kvtier.integrations.sglang import KvtierStorage
from kvtier.tiers._mooncake_env import store_class
from kvtier.tiers.local_cluster import LocalCluster
from sglang_pools import config, idx, page_bytes, sglang_mla_pool, sglang_pool

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    store_class()  # loads the system libraries Mooncake links before SGLang imports it
    with LocalCluster(storage_nodes=1, segment_bytes=128 << 20, lease_ttl_ms=200,
                      log_dir=tmp_path_factory.mktemp("logs")) as c:
        yield c


def sglang_store(cluster, pool, mla=False, tp_rank=0, tp_size=1):
    cfg = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
        enable_storage_metrics=False, is_page_first_layout=pool.layout == "page_first",
        model_name="XiaomiMiMo/MiMo-V2-Flash",
        extra_config={"master_server_address": cluster.master_address, "protocol": "tcp", "global_segment_size": 0,
                      "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "check_server": False})
    if mla:  # what SGLang's constructor sets (the CPU-built test pool skips it)
        pool._size_per_token = pool.kv_cache_dim * pool.dtype.itemsize * pool.layer_num
    s = MooncakeStore(cfg, pool)
    s.register_mem_pool_host(pool)
    return s


def kvtier_store(tmp_path, cluster, pool, mla=False, **mooncake):
    be = KvtierStorage(config(tmp_path, mla=mla, layout=pool.layout, tiers=["disk", "mooncake"],
                              mooncake={"master_server_address": cluster.master_address, **mooncake}))
    be.register_mem_pool_host(pool)
    return be


def same_pages(a, pa, b, pb):
    return all(torch.equal(x, y) for x, y in zip(page_bytes(a, pa), page_bytes(b, pb)))


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_pages_written_by_sglang_are_read_by_kvtier_only_when_allowed(tmp_path, cluster, layout):
    keys = [f"sg2kv-{layout}-{i}" for i in range(4)]
    src = sglang_pool(layout, seed=1)
    sg = sglang_store(cluster, src)
    assert sg.batch_set_v1(keys, idx(range(4))) == [True] * 4
    strict = kvtier_store(tmp_path / "strict", cluster, sglang_pool(layout, seed=2))
    assert strict.batch_exists(keys) == 0  # no kvtier integrity record: not vouched for
    assert strict.batch_get_v1(keys, idx(range(4))) == [False] * 4
    strict.close()
    dst = sglang_pool(layout, seed=3)
    loose = kvtier_store(tmp_path / "loose", cluster, dst, accept_unverified=True)
    assert loose.batch_exists(keys) == 4
    assert loose.batch_get_v1(keys, idx(range(4, 8))) == [True] * 4
    assert all(same_pages(src, i, dst, 4 + i) for i in range(4))
    st = loose.kvtier_stats()
    assert st["mooncake"]["hits"] == 4 and st["mooncake"]["store"]["unverified_served"] == 4
    # served unverified: not copied to the local disk (it would gain a fresh, valid checksum there)
    assert st["disk"]["fills"] == 0 and loose.store.batch_exists(keys) == 0
    loose.close()


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_pages_written_by_kvtier_are_hits_for_sglang(tmp_path, cluster, layout):
    keys = [f"kv2sg-{layout}-{i}" for i in range(4)]
    src = sglang_pool(layout, seed=4)
    be = kvtier_store(tmp_path, cluster, src)
    assert be.batch_set_v1(keys, idx(range(4))) == [True] * 4
    assert be.store.batch_exists(keys) == 4  # durable on the local disk first
    dst = sglang_pool(layout, seed=5)
    sg = sglang_store(cluster, dst)
    assert sg.batch_exists(keys) == 4
    assert sg.batch_get_v1(keys, idx(range(4, 8))) == [True] * 4
    assert all(same_pages(src, i, dst, 4 + i) for i in range(4))
    be.close()


def test_mla_pages_both_ways(tmp_path, cluster):
    keys = [f"mla-{i}" for i in range(3)]
    src, dst = sglang_mla_pool("page_first_direct", seed=6), sglang_mla_pool("page_first_direct", seed=7)
    sg = sglang_store(cluster, src, mla=True)
    assert sg.batch_set_v1(keys, idx(range(3))) == [True] * 3
    be = kvtier_store(tmp_path / "a", cluster, dst, mla=True, accept_unverified=True)
    assert be.batch_get_v1(keys, idx(range(3, 6))) == [True] * 3
    assert torch.equal(src.kv_buffer[:3].view(torch.uint8), dst.kv_buffer[3:6].view(torch.uint8))
    be.close()
    keys2 = [f"mla2-{i}" for i in range(3)]
    w = kvtier_store(tmp_path / "b", cluster, src, mla=True)
    assert w.batch_set_v1(keys2, idx(range(3))) == [True] * 3
    r = sglang_store(cluster, sglang_mla_pool("page_first_direct", seed=8), mla=True, tp_rank=1, tp_size=2)
    assert r.batch_get_v1(keys2, idx(range(3, 6))) == [True] * 3
    assert torch.equal(src.kv_buffer[:3].view(torch.uint8), r.mem_pool_host.kv_buffer[3:6].view(torch.uint8))
    w.close()


def test_the_factory_builds_the_chain_from_extra_config(tmp_path, cluster):
    pool = sglang_pool("page_first_direct", seed=9)
    cfg = config(tmp_path, tiers=["disk", "mooncake"], mooncake={"master_server_address": cluster.master_address})
    be = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    inner = getattr(be, "_backend", be)
    be.register_mem_pool_host(pool)
    assert be.batch_set_v1(["fac-0"], idx([0])) == [True]
    assert inner.tiers is not None and inner.tiers.tiers[1][1].batch_exists(["fac-0"]) == 1
    be.close()


@pytest.mark.parametrize("extra, match", [
    ({"tiers": ["mooncake"]}, "tiers"),
    ({"tiers": ["disk", "mooncake", "s3"]}, "tiers"),
    ({"tiers": "disk"}, "tiers"),
    ({"tiers": ["disk", "mooncake"]}, "mooncake"),
    ({"tiers": ["disk", "mooncake"], "mooncake": {"master_server_address": "127.0.0.1:1", "protocl": "tcp"}}, "protocl"),
    ({"mooncake": {"master_server_address": "127.0.0.1:1"}}, "mooncake"),
    ({"tiers": ["disk", "mooncake"], "mooncake": {"master_server_address": "127.0.0.1:1", "protocol": "udp"}}, "protocol"),
    ({"tiers": ["disk", "mooncake"], "mooncake": {"master_server_address": "nohost"}}, "master_server_address"),
    ({"tiers": ["disk", "mooncake"], "mooncake": {"master_server_address": "127.0.0.1:1", "accept_unverified": "false"}},
     "accept_unverified"),
])
def test_bad_tier_configuration_is_refused_before_anything_opens(tmp_path, extra, match):
    with pytest.raises(InvalidArgumentError, match=match):
        KvtierStorage(config(tmp_path, **extra))
    assert not any(tmp_path.iterdir())  # nothing created on disk


def test_a_stopped_storage_process_never_stalls_sglangs_prefetch_nor_lands_in_its_pool(tmp_path):
    """SGLang over the disk and the cluster: a Mooncake storage process stopped with SIGSTOP (alive, never
    answering) while SGLang reads pages only the cluster holds. The batch answers by its deadline; the late
    read, once the process is continued, lands in kvtier's staging pages, never in SGLang's pool."""
    import os
    import signal
    import threading
    import time

    with LocalCluster(storage_nodes=1, segment_bytes=64 << 20, client_ttl_s=10, lease_ttl_ms=200,
                      log_dir=tmp_path / "logs") as c:
        keys = [f"stop-sglang-{i}" for i in range(4)]
        src = sglang_pool("page_first_direct", seed=3)
        w = kvtier_store(tmp_path / "writer", c, src)
        assert w.batch_set_v1(keys, idx(range(4))) == [True] * 4
        w.close()
        dst = sglang_pool("page_first_direct", seed=4)
        for t in (dst.k_buffer, dst.v_buffer):
            t.zero_()
        be = KvtierStorage(config(tmp_path / "reader", layout="page_first_direct", tiers=["disk", "mooncake"],
                                  read_deadline_s=0.5,
                                  mooncake={"master_server_address": c.master_address}))
        be.register_mem_pool_host(dst)
        assert be.batch_exists(keys) == 4  # in the cluster only: the reader's disk is empty
        os.kill(c.nodes[0].pid, signal.SIGSTOP)
        try:
            box = {}
            t = threading.Thread(target=lambda: box.setdefault("v", be.batch_get_v1(keys, idx([4, 5, 6, 7]))),
                                 daemon=True)
            t.start()
            t.join(120)
            assert not t.is_alive(), "SGLang's prefetch thread hung behind a stopped storage process"
            assert box["v"] == [False] * 4
        finally:
            os.kill(c.nodes[0].pid, signal.SIGCONT)
        while be.kvtier_stats()["deadlines"]["fenced_pages"]:  # until the continued process answers
            time.sleep(0.05)
        assert not dst.k_buffer.view(torch.uint8).any() and not dst.v_buffer.view(torch.uint8).any()
        deadline = time.monotonic() + 120
        while be.batch_get_v1(keys, idx([4, 5, 6, 7])) != [True] * 4:  # (past the breaker's cool-down, if tripped)
            assert time.monotonic() < deadline, "the cluster never served again"
            time.sleep(0.5)
        assert all(same_pages(src, i, dst, 4 + i) for i in range(4))
        be.close()


def test_metrics_report_the_disk_once_and_the_cluster_tier_itself(tmp_path, cluster):
    """kvtier.metrics over a backend with the cluster tier, whose chain reads the disk through its staging view
    (deadlines on): the disk's store families once, even with the chain named too; the chain's view of each
    tier; the cluster tier's own integrity counters."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvtier.metrics import KvtierCollector

    be = kvtier_store(tmp_path, cluster, sglang_pool("page_first_direct", seed=4))
    try:
        keys = [f"metrics-{i}" for i in range(4)]
        assert be.batch_set_v1(keys, idx(range(4))) == [True] * 4
        be.store.delete(keys[:2])
        assert be.batch_get_v1(keys, idx(range(4, 8))) == [True] * 4
        reg = CollectorRegistry()
        reg.register(KvtierCollector(stores=[be, be.tiers]))
        samples = [(s.name, s.labels, s.value) for f in text_string_to_metric_families(generate_latest(reg).decode())
                   for s in f.samples]
    finally:
        be.close()
    assert len([s for s in samples if s[0] == "kvtier_store_objects"]) == 1
    assert ("kvtier_tier_pages_total", {"tier": "mooncake", "event": "hit"}, 2.0) in samples
    assert ("kvtier_tier_pages_total", {"tier": "disk", "event": "fill"}, 2.0) in samples
    assert ("kvtier_cluster_pages_total", {"event": "corrupt"}, 0.0) in samples
    assert [v for n, ls, v in samples if n == "kvtier_store_calls_total" and ls == {"backend": "store0", "kind": "read"}
            and v >= 1]
