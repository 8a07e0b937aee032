"""The Mooncake cluster tier against a real Mooncake master and storage processes on 127.0.0.1 (LocalCluster):
round trips, SGLang's key names, integrity (torn, stale, swapped, corrupt, foreign objects), a storage process
killed, the master restarted, bad configuration, arguments checked before any IO, the tier chain, two and
three client processes. Every test sends traffic to loopback only and stops what it starts."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from kvtier import PageStore, TierController, host_pool_for
from kvtier._errors import InvalidArgumentError, KvtierError
from kvtier.tiers import TieredStore
from kvtier.tiers.local_cluster import LocalCluster, free_port
from kvtier.tiers.objects.records import record_bytes as _record
from kvtier.tiers.mooncake import MooncakeTier
from bench_checkout import run_bench
from demo_checkout import run_demo
from mla_pools import filled, rows
from store_pools import make_pool, page_bytes, pages_idx

pytestmark = pytest.mark.timeout(240)
KEYS = [f"{i:064x}" for i in range(8)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(storage_nodes=2, segment_bytes=128 << 20, lease_ttl_ms=200, client_ttl_s=2,
                      log_dir=tmp_path_factory.mktemp("cluster-logs")) as c:
        yield c


def tier(cluster, pool, **kw):
    t = MooncakeTier(cluster.master_address, model_name=kw.pop("model_name", "org/model"), **kw)
    t.register_mem_pool_host(pool)
    return t


def same(hp_a, a, hp_b, b):
    return all(torch.equal(x, y) for x, y in zip(page_bytes(hp_a, a), page_bytes(hp_b, b)))


def until(cond, guard_s=60.0):
    """Polls ``cond()`` until it holds: True, or False once ``guard_s`` has passed (a hang guard, far past the
    few seconds the wait takes: the assertion on it fails instead of the test hanging)."""
    end = time.monotonic() + guard_s
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


#: The deadlines of a controller's calls to a live cluster in these tests: a hang guard that no load makes a
#: call on loopback miss (a missed lookup or read would be a recompute, and the breaker trips on one miss)
LIVE_DEADLINE_S = 30.0


def remove_when_unleased(store, key):
    """Mooncake refuses to remove an object read within its lease: retry until it goes (the module's timeout
    mark is the hang guard)."""
    while store.remove(key) != 0:
        time.sleep(0.1)


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_round_trip_bit_exact_under_sglangs_key_names(cluster, layout):
    keys = [f"rt-{layout}-{i}" for i in range(6)]
    src, dst = make_pool(layout, seed=1), make_pool(layout, seed=2)
    with tier(cluster, src) as a, tier(cluster, dst) as b:
        assert a.batch_set_v1(keys, pages_idx(range(6))) == [True] * 6
        assert a.data_keys(keys[0]) == [f"org-model_{keys[0]}_0_k", f"org-model_{keys[0]}_0_v"]
        assert a.record_key(keys[0]) == f"org-model_{keys[0]}_0_kvtier"
        assert b.batch_exists(keys) == 6 and b.batch_exists(keys[:2] + ["absent"] + keys[2:]) == 2
        # read back into other pages, in another order, from another client
        assert b.batch_get_v1(keys[::-1], pages_idx(range(10, 16))) == [True] * 6
        for i in range(6):
            assert same(src, i, dst, 15 - i)
        assert a.batch_set_v1(keys, pages_idx(range(6))) == [True] * 6  # present: not re-sent
        assert a.get_stats()["skipped_present"] == 6 and b.get_stats()["hits"] == 6


def test_mla_pool_one_object_per_page_shared_by_ranks(cluster):
    src, dst = host_pool_for(filled(seed=3), layout="page_first_direct"), host_pool_for(filled(seed=4), layout="page_first_direct")
    src.kv_buffer.view(torch.uint8).copy_(torch.randint(0, 256, src.kv_buffer.view(torch.uint8).shape, dtype=torch.uint8))
    keys = [f"mla-{i}" for i in range(4)]
    with tier(cluster, src, tp_rank=0, tp_size=2) as w, tier(cluster, dst, tp_rank=1, tp_size=2) as r:
        assert w.data_keys("h") == ["org-model_h__k"]  # SGLang's MLA key: no rank in it
        assert w.batch_set_v1(keys, rows(range(4))) == [True] * 4
        assert r.batch_get_v1(keys, rows(range(4, 8))) == [True] * 4
        assert torch.equal(src.kv_buffer[:4].view(torch.uint8), dst.kv_buffer[4:8].view(torch.uint8))


def test_integrity_every_damaged_object_is_a_miss_never_wrong_bytes(cluster):
    src, dst = make_pool(seed=5), make_pool(seed=6)
    keys = [f"dmg-{i}" for i in range(6)]
    with tier(cluster, src) as t, tier(cluster, dst) as r:
        assert t.batch_set_v1(keys, pages_idx(range(6))) == [True] * 6
        s = t._store
        k0, v0 = t.data_keys(keys[0])
        n = page_bytes(src, 0)[0].numel()
        # 0: a K object replaced by other bytes of the same size (a reclaimed or overwritten object)
        remove_when_unleased(s, k0)
        assert s.put(k0, bytes(n)) == 0
        # 1: K and V swapped (same sizes would need equal dims; here: V's bytes under K's key, re-sized)
        k1, v1 = t.data_keys(keys[1])
        remove_when_unleased(s, k1)
        assert s.put(k1, s.get(v1)) == 0
        # 2: a torn integrity record
        rec2 = t.record_key(keys[2])
        raw = s.get(rec2)
        remove_when_unleased(s, rec2)
        assert s.put(rec2, raw[:-3]) == 0
        # 3: a record of another geometry (another writer's fingerprint)
        rec3 = t.record_key(keys[3])
        remove_when_unleased(s, rec3)
        assert s.put(rec3, _record(b"otherfp!", [(n, 0), (n, 0)])) == 0
        # 4: no record at all (a page as a stock SGLang node writes it)
        remove_when_unleased(s, t.record_key(keys[4]))
        dst.k_buffer.fill_(0x5A)
        assert r.batch_get_v1(keys, pages_idx(range(6))) == [False, False, False, False, False, True]
        assert same(src, 5, dst, 5)
        st = r.get_stats()
        # 0 (same size, other bytes: its checksum) and 1 (another size: it came back resized) are corrupt
        assert st["corrupt"] == 2 and st["stale"] == 2 and st["misses"] == 5, st
        assert r.batch_exists(keys[4:]) == 0  # data without a record is not present
        with tier(cluster, dst, accept_unverified=True) as loose:
            assert loose.batch_exists(keys[4:]) == 2
            assert loose.batch_get_v1(keys[4:5], pages_idx([4])) == [True]
            assert same(src, 4, dst, 4) and loose.get_stats()["unverified_served"] == 1
        # a page stored without a record: a writer adds the record only when the stored bytes are its own
        assert t.batch_set_v1(keys[4:5], pages_idx([4])) == [True]  # they are (this writer's, record lost)
        assert r.batch_get_v1(keys[4:5], pages_idx([4])) == [True] and same(src, 4, dst, 4)
        other = make_pool(seed=16)
        fk, fv = t.data_keys("foreign")
        kb, vb = page_bytes(other, 0)
        assert s.put(fk, kb.numpy().tobytes()) == 0 and s.put(fv, vb.numpy().tobytes()) == 0  # a stock node's page
        assert t.batch_set_v1(["foreign"], pages_idx([0])) == [False]  # other bytes: never vouched for
        assert t.get_stats()["unverified_skipped"] == 1 and r.batch_exists(["foreign"]) == 0
        hk, _ = t.data_keys("half")
        assert s.put(hk, page_bytes(src, 2)[0].numpy().tobytes()) == 0  # a write that stopped after K
        assert t.batch_set_v1(["half"], pages_idx([2])) == [True]  # K is ours: V and the record complete it
        assert r.batch_get_v1(["half"], pages_idx([7])) == [True] and same(src, 2, dst, 7)


def test_a_different_model_dtype_or_geometry_misses(cluster):
    src = make_pool(seed=7)
    keys = [f"geo-{i}" for i in range(3)]
    with tier(cluster, src) as t:
        assert t.batch_set_v1(keys, pages_idx(range(3))) == [True] * 3
    for other, kw in ((make_pool(seed=7, dtype=torch.float16), {}), (make_pool(seed=7), {"kv_cache_dtype": "fp8_e5m2"}),
                      (make_pool(seed=7, layers=4), {})):
        with tier(cluster, other, **kw) as r:
            assert r.batch_exists(keys) == 3  # the same SGLang keys exist ...
            assert r.batch_get_v1(keys, pages_idx(range(3))) == [False] * 3  # ... but are never served
            assert r.get_stats()["stale"] == 3
    with tier(cluster, make_pool(seed=7), model_name="org/other") as r:
        assert r.batch_exists(keys) == 0


def test_arguments_are_checked_before_any_io(cluster):
    hp = make_pool(seed=8)
    with tier(cluster, hp) as t:
        before = t.get_stats()
        bad = [
            (["a"], pages_idx([0])[1:]),  # too few slots
            (["a"], pages_idx([0]) + 1),  # not page-aligned
            (["a"], pages_idx([hp.size // 4])),  # past the pool
            (["a"], -pages_idx([1])),  # negative
            (["a"], pages_idx([0]).to(torch.int32)),  # wrong dtype
            ("abc", pages_idx([0, 1, 2])),  # one str, not keys
        ]
        for keys, idx in bad:
            for op in (t.batch_set_v1, t.batch_get_v1):
                with pytest.raises(InvalidArgumentError):
                    op(keys, idx)
        with pytest.raises(InvalidArgumentError, match="overlapping"):
            t.batch_get_v1(["a", "b"], pages_idx([0, 0]))
        assert t.get_stats() == before
        assert t.batch_exists(["a"]) == 0


def test_bad_configuration_is_one_clear_error_at_construction(tmp_path):
    closed = free_port()
    # (refused rather than waited on: pytest-timeout bounds the call, no wall-clock assertion here)
    with pytest.raises(KvtierError, match="cannot reach the master"):
        MooncakeTier(f"127.0.0.1:{closed}", model_name="m")
    for kw, match in (({"protocol": "udp"}, "protocol"), ({"protocol": "rdma"}, "device_name"),
                      ({"global_segment_size": -1}, "global_segment_size"), ({"replica_num": 0}, "replica_num"),
                      ({"tp_rank": 2, "tp_size": 2}, "tp_rank"), ({"accept_unverified": "false"}, "accept_unverified"),
                      ({"dcp_size": 2}, "dcp_size"), ({"model_name": ""}, "model_name"), ({"key_tag": ""}, "key_tag")):
        with pytest.raises(InvalidArgumentError, match=match):
            MooncakeTier(f"127.0.0.1:{closed}", **{"model_name": "m", **kw})
    for addr in ("localhost", "127.0.0.1:0", "127.0.0.1:http", ":80"):
        with pytest.raises(InvalidArgumentError, match="master_server_address"):
            MooncakeTier(addr, model_name="m")
    with LocalCluster(storage_nodes=0, log_dir=tmp_path) as c:  # a master with no memory mounted anywhere
        with pytest.raises(KvtierError, match="cannot store objects"):
            MooncakeTier(c.master_address, model_name="m", global_segment_size=0)
        t = MooncakeTier(c.master_address, model_name="m", global_segment_size=32 << 20)  # brings its own memory
        t.register_mem_pool_host(make_pool())
        assert t.batch_set_v1(["own"], pages_idx([0])) == [True]
        t.close()
        with pytest.raises(KvtierError, match="closed"):
            t.batch_exists(["own"])


def chain(tmp_path, cluster, pool, name="node"):
    disk = PageStore(tmp_path / name, capacity_bytes=1 << 30, model_name="org/model")
    disk.register_mem_pool_host(pool)
    return TieredStore([("disk", disk), ("mooncake", tier(cluster, pool))])


def test_tier_chain_fills_the_local_disk_from_the_cluster(tmp_path, cluster):
    a_pool, b_pool = make_pool(seed=9), make_pool(seed=10)
    keys = [f"chain-{i}" for i in range(5)]
    with chain(tmp_path, cluster, a_pool, "a") as a, chain(tmp_path, cluster, b_pool, "b") as b:
        assert a.batch_set_v1(keys, pages_idx(range(5))) == [True] * 5  # durable on a's disk, then the cluster
        assert b.first.batch_exists(keys) == 0 and b.batch_exists(keys) == 5  # b: only in the cluster
        assert b.batch_get_v1(keys, pages_idx(range(5, 10))) == [True] * 5
        assert all(same(a_pool, i, b_pool, 5 + i) for i in range(5))
        st = b.get_stats()
        assert st["mooncake"]["hits"] == 5 and st["disk"]["misses"] == 5 and st["disk"]["fills"] == 5
        assert b.first.batch_exists(keys) == 5  # the read filled b's disk
        # a page only on disk followed by pages only in the cluster: the run spans both tiers
        a.first.delete(keys[2:])
        assert a.first.batch_exists(keys) == 2 and a.batch_exists(keys) == 5


def test_tier_controller_prefetches_through_the_chain(tmp_path, cluster):
    from kvtier import DeviceKVPool

    dev = DeviceKVPool(16 * 4, 4, 3, 2, 192, 128, torch.bfloat16, "cpu")
    hp = host_pool_for(dev, layout="page_first_direct", host_to_device_ratio=1.0)
    src = make_pool(seed=11)
    keys = [f"ctl-{i}" for i in range(4)]
    with chain(tmp_path, cluster, src, "writer") as w:
        assert w.batch_set_v1(keys, pages_idx(range(4))) == [True] * 4
    store = chain(tmp_path, cluster, hp, "reader")
    ctl = TierController(dev, hp, store, restore_deadline=LIVE_DEADLINE_S, lookup_deadline_s=LIVE_DEADLINE_S)
    try:
        assert ctl.match(keys) == (0, 4)
        assert ctl.prefetch(keys).result() == 4
        assert ctl.stats.prefetched_pages == 4
        ld = ctl.load(keys, torch.arange(16, dtype=torch.int64))
        ld.synchronize()
        for i in range(4):
            for side, buf in ((0, dev.k_buffer), (1, dev.v_buffer)):
                want = page_bytes(src, i)[side]
                got = torch.cat([buf[layer][i * 4:(i + 1) * 4].reshape(-1).view(torch.uint8) for layer in range(3)])
                assert torch.equal(got, want), (i, side)
    finally:
        ctl.close()
        store.close()


def test_killed_storage_process_misses_and_the_disk_still_serves(tmp_path):
    with LocalCluster(storage_nodes=1, segment_bytes=64 << 20, client_ttl_s=2, lease_ttl_ms=200,
                      log_dir=tmp_path / "logs") as c:
        src, dst = make_pool(seed=12), make_pool(seed=13)
        keys = [f"kill-{i}" for i in range(6)]
        with chain(tmp_path, c, src, "a") as a, chain(tmp_path, c, dst, "b") as b:
            assert a.batch_set_v1(keys, pages_idx(range(6))) == [True] * 6
            a.first.delete(keys[3:])  # a's disk keeps pages 0-2 only
            c.kill_node(0)
            # the master still lists the objects for client_ttl: present, but every read fails -> misses
            dst.k_buffer.fill_(0x33)
            assert b.batch_get_v1(keys, pages_idx(range(6))) == [False] * 6
            assert b.get_stats()["mooncake"]["hits"] == 0
            # a re-put in that window is "acknowledged" by Mooncake and stores nothing: never a false ack
            # here, because the chain acknowledges from the durable local tier only
            assert a.batch_set_v1(keys[:3], pages_idx(range(3))) == [True] * 3
            assert a.batch_get_v1(keys[:3], pages_idx(range(8, 11))) == [True] * 3  # a's disk serves
            assert all(same(src, i, src, 8 + i) for i in range(3))
            assert a.batch_get_v1(keys[3:], pages_idx(range(3, 6))) == [False] * 3
            # past client_ttl (2 s) the master forgets the dead node's objects (polled: when its check runs is
            # the master's business; the guard only ends a wait that would never end)
            assert until(lambda: b.batch_exists(keys) == 0), "the master still lists the dead node's objects"
            assert a.batch_exists(keys) == 3


def test_master_restart(tmp_path):
    with LocalCluster(storage_nodes=1, segment_bytes=64 << 20, client_ttl_s=2, log_dir=tmp_path / "logs") as c:
        src = make_pool(seed=14)
        keys = [f"mr-{i}" for i in range(4)]
        with chain(tmp_path, c, src, "a") as a:
            assert a.batch_set_v1(keys, pages_idx(range(4))) == [True] * 4
            c.stop_master()
            # the cluster is unreachable: misses and failed cluster writes, the disk still acknowledges and serves
            assert a.batch_set_v1(["mr-new"], pages_idx([5])) == [True]
            assert a.batch_get_v1(keys, pages_idx(range(8, 12))) == [True] * 4
            c.start_master()  # same port, empty: the old objects are gone
            c.add_node()
            tier_ = a.tiers[1][1]
            while tier_.batch_set_v1(keys, pages_idx(range(4))) != [True] * 4:  # until the client is back
                time.sleep(0.5)
            assert tier_.batch_exists(keys) == 4


CLIENT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from store_pools import make_pool, page_bytes, pages_idx
    from kvtier.tiers.mooncake import MooncakeTier
    role, addr, seed, first, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    t = MooncakeTier(addr, model_name="org/xproc")
    if role == "write":
        hp = make_pool(seed=seed, pages=64)
        t.register_mem_pool_host(hp)
        ok = t.batch_set_v1([f"x-{{i}}" for i in range(first, first + n)], pages_idx(range(first, first + n)))
        assert all(ok), ok
    else:  # read every page, check it against its writer's pool (seed by key range)
        hp = make_pool(seed=999, pages=64)
        t.register_mem_pool_host(hp)
        for lo, s in ((0, 100), (16, 101), (32, 102)):
            ref = make_pool(seed=s, pages=64)
            keys = [f"x-{{i}}" for i in range(lo, lo + 16)]
            assert t.batch_get_v1(keys, pages_idx(range(lo, lo + 16))) == [True] * 16
            for i in range(lo, lo + 16):
                assert all(torch.equal(a, b) for a, b in zip(page_bytes(ref, i), page_bytes(hp, i))), i
    t.close()
    print("ok", role, first)
""")


def test_cross_node_hits_between_client_processes_writing_concurrently(tmp_path, cluster):
    script = tmp_path / "client.py"
    script.write_text(CLIENT.format(tests=os.path.dirname(__file__)))
    env = {**os.environ, "PYTHONPATH": os.path.dirname(__file__)}
    writers = [subprocess.Popen([sys.executable, str(script), "write", cluster.master_address, str(s), str(lo), "16"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
               for lo, s in ((0, 100), (16, 101), (32, 102))]
    for w in writers:
        out, err = w.communicate(timeout=120)
        assert w.returncode == 0, err.decode()[-2000:]
    r = subprocess.run([sys.executable, str(script), "read", cluster.master_address, "0", "0", "0"],
                       capture_output=True, timeout=120, env=env)
    assert r.returncode == 0 and b"ok read" in r.stdout, r.stderr.decode()[-2000:]


def test_prometheus_collector_reports_each_tier(tmp_path, cluster):
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest

    from kvtier.metrics import KvtierCollector

    src = make_pool(seed=15)
    keys = [f"prom-{i}" for i in range(3)]
    with chain(tmp_path, cluster, src, "p") as c:
        assert c.batch_set_v1(keys, pages_idx(range(3))) == [True] * 3
        c.first.delete(keys)
        assert c.batch_get_v1(keys, pages_idx(range(3, 6))) == [True] * 3
        reg = CollectorRegistry()
        reg.register(KvtierCollector(stores=[c]))
        text = generate_latest(reg).decode()
        assert 'kvtier_tier_pages_total{event="hit",tier="mooncake"} 3.0' in text
        assert 'kvtier_tier_pages_total{event="fill",tier="disk"} 3.0' in text
        assert 'kvtier_cluster_pages_total{event="corrupt"} 0.0' in text
        assert "kvtier_store_objects" in text  # the disk tier's own store metrics


@pytest.mark.timeout(600)  # a hang guard: ~20 s alone, ~95 s with both cores of a 2-core machine busy
def test_demo_cluster_node_b_serves_node_as_prefixes_from_the_cluster(tmp_path):
    r = run_demo("--cluster", "--conversations", "2", "--turns", "2", "--store-dir", str(tmp_path / "demo"),
                 timeout=540)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    b = r.stdout.split("== node B")[1]
    assert "cluster hit" in b and "integrity misses 0" in b
    assert r.stdout.count("for all 4 requests: True") == 2
    assert "demo --cluster: all checks passed" in r.stdout


def test_bench_runs_and_checks_bytes(tmp_path):
    r = run_bench("mooncake", "--reps", "1", "--cases", "64KiB", "--out", str(tmp_path / "out"), timeout=200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    import json

    row = json.loads((tmp_path / "out" / "cpu-mooncake.json").read_text())["rows"][0]
    # the bytes moved and that every step ran (its rates are the benchmark's to report, not this test's to judge)
    assert row["bit_exact"] is True and row["case"] == "64KiB"
    assert row["objects_per_batch"] == 256 and row["object_bytes"] == [64 << 10] and row["batch_bytes"] == 256 << 16
    assert {k: len(v) for k, v in row["all"].items()} == dict.fromkeys(
        ("raw_put", "raw_get", "raw_rec_put", "raw_rec_get", "kvtier_put", "kvtier_get", "exist", "crc32c"), 1)


def test_ranks_and_sizes_that_change_the_bytes_change_the_fingerprint(cluster):
    # GQA heads replicated over ranks: rank 1 of TP 4 and rank 1 of TP 8 both hold one head per rank under
    # the same SGLang key, but not the same head
    src = make_pool(seed=17, heads=1)
    keys = [f"tp-{i}" for i in range(2)]
    with tier(cluster, src, tp_rank=1, tp_size=4) as w:
        assert w.batch_set_v1(keys, pages_idx(range(2))) == [True] * 2
    for kw in ({"tp_rank": 1, "tp_size": 8}, {"tp_rank": 1, "tp_size": 4, "cp_rank": 0, "cp_size": 2}):
        with tier(cluster, make_pool(seed=18, heads=1), **kw) as r:
            assert r.data_keys(keys[0])[0].endswith("_1_k")  # the same keys ...
            assert r.batch_get_v1(keys, pages_idx(range(2))) == [False] * 2  # ... never served across sizes
            assert r.get_stats()["stale"] == 2


def test_repeated_keys(cluster):
    src, dst = make_pool(seed=19), make_pool(seed=20)
    with tier(cluster, src) as t:
        assert t.batch_set_v1(["rep", "rep2", "rep"], pages_idx([0, 1, 2])) == [True] * 3
        with pytest.raises(InvalidArgumentError, match="twice"):
            t.batch_get_v1(["rep", "rep"], pages_idx([4, 5]))
        assert tier(cluster, dst).batch_get_v1(["rep", "rep2"], pages_idx([4, 5])) == [True, True]
        assert same(src, 0, dst, 4) and same(src, 1, dst, 5)  # the first occurrence was stored


def test_a_record_whose_data_is_gone_does_not_block_the_page(cluster):
    src, dst = make_pool(seed=21), make_pool(seed=22)
    keys = [f"orph-{i}" for i in range(3)]
    with tier(cluster, src) as t:
        assert t.batch_set_v1(keys, pages_idx(range(3))) == [True] * 3
        for k in t.data_keys(keys[1]):  # the data evicted (or lost with a node), the record left behind
            remove_when_unleased(t._store, k)
        assert t.batch_exists(keys) == 1
        assert t.batch_set_v1(keys, pages_idx(range(3))) == [True] * 3  # rewritten, not "already present"
        assert t.get_stats()["put_pages"] == 4
        with tier(cluster, dst) as r:
            assert r.batch_get_v1(keys, pages_idx(range(3))) == [True] * 3 and same(src, 1, dst, 1)


def test_pages_served_unverified_are_never_vouched_for_nor_filled(tmp_path, cluster):
    stock = make_pool(seed=23)
    with tier(cluster, stock) as w:  # a stock SGLang node: data objects, no records
        assert w.batch_set_v1(["stock"], pages_idx([0])) == [True]
        remove_when_unleased(w._store, w.record_key("stock"))
    node = make_pool(seed=24)
    disk = PageStore(tmp_path / "d", capacity_bytes=1 << 30, model_name="org/model")
    disk.register_mem_pool_host(node)
    loose = tier(cluster, node, accept_unverified=True)
    with TieredStore([("disk", disk), ("mooncake", loose)]) as c:
        assert c.batch_get_v1(["stock"], pages_idx([3])) == [True] and same(stock, 0, node, 3)
        assert disk.batch_exists(["stock"]) == 0  # not made durable under a fresh checksum
        assert c.get_stats()["disk"]["fills"] == 0
        # writing the page back from this node's host (the bytes it just read) adds no record either
        assert loose.batch_set_v1(["stock"], pages_idx([3])) == [False]
        with tier(cluster, make_pool(seed=25)) as strict:
            assert strict.batch_get_v1(["stock"], pages_idx([0])) == [False]


def test_close_waits_for_calls_in_flight(cluster):
    import threading

    hp = make_pool(seed=26, pages=64)
    t = tier(cluster, hp)
    errors, stop = [], threading.Event()
    rounds = [threading.Event() for _ in range(3)]  # each worker's first round done: it is looping

    def work(n):
        i = 0
        while not stop.is_set():
            try:
                t.batch_set_v1([f"cl-{n}-{i}-{j}" for j in range(8)], pages_idx(range(8 * n, 8 * n + 8)))
                t.batch_get_v1([f"cl-{n}-{i}-{j}" for j in range(8)], pages_idx(range(32 + 8 * n, 40 + 8 * n)))
            except KvtierError as e:  # ClosedError once closed: the only acceptable failure
                if "closed" not in str(e):
                    errors.append(e)
                return
            rounds[n].set()
            i += 1

    threads = [threading.Thread(target=work, args=(n,)) for n in range(3)]
    for th in threads:
        th.start()
    # every worker in its loop of batches (not a sleep that a loaded machine may end before any batch ran)
    assert all(r.wait(60) for r in rounds) and not errors, errors
    t.close()  # while the workers are inside batches
    stop.set()
    for th in threads:
        th.join(timeout=30)
    assert not errors and not any(th.is_alive() for th in threads)
    with pytest.raises(KvtierError, match="closed"):
        t.batch_exists(["x"])


def test_chain_raises_on_bad_arguments_like_its_first_tier(tmp_path, cluster):
    with chain(tmp_path, cluster, make_pool(seed=27), "args") as c:
        for idx in (pages_idx([0]).to(torch.int32), pages_idx([0]) + 1, pages_idx([10 ** 6])):
            with pytest.raises(InvalidArgumentError):
                c.batch_get_v1(["a"], idx)


# ------------------------------------------------------------------ an adversarial review of the cluster tier
def test_key_tag_namespaces_do_not_serve_each_others_pages(cluster):
    """A tagged page "x" and an untagged page "m_x" of model "m" are the same Mooncake objects (SGLang joins
    the names with "_"): the record names the key tag, so each namespace misses the other's page instead of
    serving it as a verified hit."""
    src, dst = make_pool("page_first", seed=11), make_pool("page_first", seed=12)
    with tier(cluster, src, model_name="m", key_tag="m") as b, tier(cluster, dst, model_name="m") as a:
        assert b.data_keys("x") == a.data_keys("m_x")
        assert b.batch_set_v1(["x"], pages_idx([0])) == [True]
        assert a.batch_get_v1(["m_x"], pages_idx([3])) == [False]
        assert b.batch_get_v1(["x"], pages_idx([4])) == [True] and same(src, 0, src, 4)


@pytest.mark.parametrize("bad", [-1, 0, "5", True])
def test_setup_timeout_is_checked(cluster, bad):
    with pytest.raises(InvalidArgumentError, match="setup_timeout_s"):
        MooncakeTier(cluster.master_address, model_name="m", setup_timeout_s=bad)


def test_chain_does_not_make_an_unverified_page_durable_on_write_back(tmp_path, cluster):
    """A page a stock node stored without a record, served unverified, then backed up again by the engine
    through the chain: the durable disk must not take it (it would vouch for its bytes)."""
    stock = make_pool("page_first", seed=23)
    with tier(cluster, stock) as w:  # a stock SGLang node: data objects, no records
        assert w.batch_set_v1(["stock2"], pages_idx([0])) == [True]
        remove_when_unleased(w._store, w.record_key("stock2"))
    node = make_pool("page_first", seed=24)
    disk = PageStore(tmp_path / "d", capacity_bytes=1 << 30, model_name="org/model")
    disk.register_mem_pool_host(node)
    with TieredStore([("disk", disk), ("mooncake", tier(cluster, node, accept_unverified=True))]) as c:
        assert c.batch_get_v1(["stock2"], pages_idx([3])) == [True]
        assert disk.batch_exists(["stock2"]) == 0
        assert c.batch_set_v1(["own", "stock2"], pages_idx([3, 4])) == [True, False]
        assert disk.batch_exists(["stock2"]) == 0 and disk.batch_exists(["own"]) == 1


def test_chain_delete_is_not_undone_by_a_tier_that_keeps_the_page(tmp_path, cluster):
    """Mooncake keeps an object another node read within its lease: the chain's delete must still make the
    page a miss (it was served again from the cluster and filled back into the disk), until it is stored
    again."""
    node, other = make_pool("page_first", seed=31), make_pool("page_first", seed=32)
    disk = PageStore(tmp_path / "d2", capacity_bytes=1 << 30, model_name="org/model")
    disk.register_mem_pool_host(node)
    with TieredStore([("disk", disk), ("mooncake", tier(cluster, node))]) as c, tier(cluster, other) as peer:
        assert c.batch_set_v1(["gone"], pages_idx([0])) == [True]
        assert peer.batch_get_v1(["gone"], pages_idx([5])) == [True]  # another node reads it (a lease)
        assert c.delete(["gone"]) == 1
        assert c.batch_get_v1(["gone"], pages_idx([1])) == [False] and c.batch_exists(["gone"]) == 0
        assert disk.batch_exists(["gone"]) == 0
        assert c.batch_set_v1(["gone"], pages_idx([0])) == [True]  # stored again: served again
        assert c.batch_get_v1(["gone"], pages_idx([2])) == [True]


def test_chain_checks_its_arguments_like_the_disk(tmp_path):
    """One str as keys, or host indices that are not a tensor: the chain raises as its first tier does,
    before any IO (it split "ab" into pages "a" and "b" and deleted them; bad indices became misses)."""
    hp = make_pool("page_first", seed=1)
    disk = PageStore(tmp_path / "d", capacity_bytes=1 << 30, model_name="m")
    disk.register_mem_pool_host(hp)
    with TieredStore([("disk", disk)]) as c:
        assert c.batch_set_v1(["a", "b"], pages_idx([0, 1])) == [True, True]
        for call in (lambda: c.delete("ab"), lambda: c.batch_set_v1("xy", pages_idx([2, 3])),
                     lambda: c.batch_exists("ab"), lambda: c.batch_get_v1("ab", pages_idx([2, 3]))):
            with pytest.raises(InvalidArgumentError, match="keys"):
                call()
        for bad in (pages_idx([2, 3]).tolist(), pages_idx([2, 3]).numpy(), pages_idx([2, 3]).int()):
            with pytest.raises(InvalidArgumentError, match="host_indices"):
                c.batch_get_v1(["a", "b"], bad)
        assert disk.batch_exists(["a", "b"]) == 2 and disk.batch_exists(["x"]) == 0


def test_a_truncated_or_extended_object_is_counted_corrupt(cluster):
    """An object whose record is intact but which comes back shorter or longer than recorded is a miss, and
    counted: the docs promise that corruption is counted."""
    src, dst = make_pool(seed=31), make_pool(seed=32)
    with tier(cluster, src) as t, tier(cluster, dst) as r:
        keys = ["trunc-0", "trunc-1", "trunc-2"]
        assert t.batch_set_v1(keys, pages_idx(range(3))) == [True] * 3
        s = t._store
        n = page_bytes(src, 0)[0].numel()
        k0, _ = t.data_keys(keys[0])
        k1, _ = t.data_keys(keys[1])
        raw0, raw1 = s.get(k0), s.get(k1)
        remove_when_unleased(s, k0)
        assert s.put(k0, raw0[: n - 512]) == 0  # truncated
        remove_when_unleased(s, k1)
        assert s.put(k1, raw1 + bytes(512)) == 0  # extended
        before = r.get_stats()["corrupt"]
        assert r.batch_get_v1(keys, pages_idx(range(3))) == [False, False, True]
        assert r.get_stats()["corrupt"] - before == 2
        assert same(src, 2, dst, 2)


def test_unverified_pages_stay_unvouched_past_the_exact_memory(tmp_path, cluster):
    """More pages served unverified than the tier remembers exactly: none of them is filled into the disk or
    given a record afterwards (the older ones live on in the tier's filter)."""
    from kvtier.tiers.objects.records import Taint

    stock = make_pool(seed=33)
    keys = [f"stock-many-{i}" for i in range(6)]
    with tier(cluster, stock) as w:  # a stock SGLang node: data objects, no records
        assert w.batch_set_v1(keys, pages_idx(range(6))) == [True] * 6
        for k in keys:
            remove_when_unleased(w._store, w.record_key(k))
    node = make_pool(seed=34)
    disk = PageStore(tmp_path / "d", capacity_bytes=1 << 30, model_name="org/model")
    disk.register_mem_pool_host(node)
    loose = tier(cluster, node, accept_unverified=True)
    loose._unverified = Taint(exact=2)  # remembers two exactly; the rest only in its filter
    with TieredStore([("disk", disk), ("mooncake", loose)]) as c:
        for i, k in enumerate(keys):  # one batch per page: the first four leave the exact set
            assert c.batch_get_v1([k], pages_idx([i])) == [True]
        assert loose._unverified.spilled == 4
        assert disk.batch_exists(keys) == 0 and c.get_stats()["disk"]["fills"] == 0
        assert loose.served_unverified(keys) == set(keys)
        assert c.batch_set_v1(keys, pages_idx(range(6))) == [False] * 6  # the engine's write-back: refused
        assert disk.batch_exists(keys) == 0


def _returns(fn, guard_s=120):
    """``fn()``'s value, asserting it came back while the cluster process is stopped (a hang fails here)."""
    import threading

    box = {}
    t = threading.Thread(target=lambda: box.update(v=fn()), daemon=True)
    t.start()
    t.join(guard_s)
    assert not t.is_alive(), "the call hung behind a stopped cluster process"
    return box["v"]


@pytest.mark.parametrize("stopped", ["storage", "master"])
def test_a_stopped_cluster_process_costs_a_recompute_not_a_hang(tmp_path, stopped):
    """A Mooncake storage process or master stopped with SIGSTOP (alive, never answering): the controller's
    lookups and reads come back at their deadlines, the pages being read stay fenced, and once the process is
    continued everything is reclaimed and the tier serves again."""
    import signal

    from kvtier import DeviceKVPool
    from kvtier.deadlines import Breaker

    with LocalCluster(storage_nodes=1, segment_bytes=64 << 20, client_ttl_s=10, lease_ttl_ms=200,
                      log_dir=tmp_path / "logs") as c:
        dev = DeviceKVPool(16 * 4, 4, 3, 2, 192, 128, torch.bfloat16, "cpu")
        hp = host_pool_for(dev, layout="page_first_direct", host_to_device_ratio=1.0)
        src = make_pool(seed=21)
        keys = [f"stop-{stopped}-{i}" for i in range(4)]
        with chain(tmp_path, c, src, "writer") as w:
            assert w.batch_set_v1(keys, pages_idx(range(4))) == [True] * 4
        store = chain(tmp_path, c, hp, "reader")  # its own disk is empty: the pages are in the cluster only
        # the calls to the live cluster (before the stop and after it) get a hang guard's deadlines; the calls
        # that meet the stopped process get 0.5 s: they cannot answer in time, whatever the load (the guard of
        # _returns ends a call that never came back)
        ctl = TierController(dev, hp, store, restore_deadline=LIVE_DEADLINE_S, lookup_deadline_s=LIVE_DEADLINE_S,
                             breaker=Breaker(threshold=1, cooldown_s=0.5))
        proc = c.master if stopped == "master" else c.nodes[0]
        try:
            assert ctl.match(keys) == (0, 4)
            assert sum(ctl.deadline_stats()["deadline_misses"].values()) == 0
            ctl.restore_deadline = ctl.lookup_deadline_s = 0.5
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                if stopped == "master":
                    # the lookup finds nothing: recompute (an answer the client still holds from the lookup just
                    # before, within Mooncake's lease of 200 ms, may come first: then the next one misses)
                    found = [_returns(lambda: ctl.match(keys))]
                    while found[-1] != (0, 0) and len(found) < 10:
                        time.sleep(0.3)
                        found.append(_returns(lambda: ctl.match(keys)))
                    assert found[-1] == (0, 0), found
                else:
                    assert _returns(lambda: ctl.prefetch(keys).result()) == 0
                    assert ctl.match(keys)[0] == 0  # fenced: not loadable
                ds = ctl.deadline_stats()
                assert sum(ds["deadline_misses"].values()) >= 1 and ds["breaker"] != "closed"
            finally:
                os.kill(proc.pid, signal.SIGCONT)
                ctl.restore_deadline = ctl.lookup_deadline_s = LIVE_DEADLINE_S
            while ctl.deadline_stats()["stuck_calls"]:  # until the continued process answers
                time.sleep(0.05)
            time.sleep(0.6)  # past the cool-down: the next call probes
            ctl.prefetch(keys).result(120)
            while ctl.match(keys)[0] < 4:  # until it serves again (then bit-exact, below)
                ctl.prefetch(keys).result(120)
                time.sleep(0.6)
            ld = ctl.load(keys, torch.arange(16, dtype=torch.int64))
            ld.synchronize()
            for i in range(4):
                got = torch.cat([dev.k_buffer[layer][i * 4:(i + 1) * 4].reshape(-1).view(torch.uint8)
                                 for layer in range(3)])
                assert torch.equal(got, page_bytes(src, i)[0]), i
        finally:
            ctl.close()
            store.close()


@pytest.mark.parametrize("sealed", [False, True])
@pytest.mark.parametrize("lost", [0, 1])  # which half Mooncake dropped: K (0) or V (1)
def test_a_page_put_again_from_another_computation_never_mixes_halves(tmp_path, cluster, sealed, lost):
    """A page's K or V object is gone (evicted, or lost with a node) and the page is put again from another
    computation (KV of the same tokens can differ between two runs on a GPU): a read serves one write's K and V
    together, or misses; never the new half beside the old one."""
    from kvtier.tenants import Keyring

    kr = Keyring.init(tmp_path / "ring") if sealed else None
    a, b, dst = make_pool(seed=31), make_pool(seed=32), make_pool(seed=33)
    keys = [f"mix-{int(sealed)}-{lost}-{i}" for i in range(3)]
    with tier(cluster, a, keyring=kr) as wa, tier(cluster, b, keyring=kr) as wb, tier(cluster, dst, keyring=kr) as r:
        assert wa.batch_set_v1(keys, pages_idx(range(3))) == [True] * 3
        for key in keys[:2]:
            remove_when_unleased(wa._store, wa.data_keys(key)[lost])
        stored = wb.batch_set_v1(keys[:2], pages_idx(range(2)))
        dst.k_buffer.fill_(0x11)
        dst.v_buffer.fill_(0x22)
        got = r.batch_get_v1(keys, pages_idx(range(3)))
        assert got[2] and same(a, 2, dst, 2)  # untouched: the first write's
        for i in range(2):
            if got[i]:  # served: the second computation's page whole (never a's other half beside b's)
                assert same(b, i, dst, i), (i, stored)
                assert stored[i]
            else:
                assert not same(b, i, dst, i) and not same(a, i, dst, i)
