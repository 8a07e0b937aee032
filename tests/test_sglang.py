"""Conformance with the real SGLang package (installed by `make test`): kvtier's HiCache storage backend is
loaded by SGLang's own factory, serves SGLang's own host pools (asymmetric and symmetric) zero-copy, and
kvtier's page hashes equal SGLang's. These tests do not skip: an SGLang release that changes these
interfaces must fail them."""

import logging
import random

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

import kvtier
from kvtier.integrations.sglang import KvtierStorage
from sglang_pools import PS, L, config, idx, page_bytes, sglang_mla_pool, sglang_pool

def test_factory_loads_kvtier_as_a_dynamic_backend(tmp_path):
    pool = sglang_pool("page_first_direct")
    be = StorageBackendFactory.create_backend("dynamic", config(tmp_path), pool)
    assert isinstance(be, HiCacheStorage)
    inner = getattr(be, "_backend", be)  # SGLang may wrap backends in a failure injector
    assert isinstance(be, KvtierStorage) or isinstance(inner, KvtierStorage)
    be.register_mem_pool_host(pool)
    assert be.batch_set_v1(["a" * 64], idx([0])) == [True]
    assert be.batch_exists(["a" * 64, "b" * 64]) == 1
    be.close()


@pytest.mark.parametrize("layout", ["page_first_direct", "page_first"])
@pytest.mark.parametrize("dims", [(192, 128), (128, 128)], ids=["asymmetric", "symmetric"])
def test_sglang_pool_round_trip_bit_exact(tmp_path, layout, dims):
    pool = sglang_pool(layout, *dims)
    keys = [f"{i:064x}" for i in range(4)]
    want = [page_bytes(pool, p) for p in range(4)]
    be = KvtierStorage(config(tmp_path, layout=layout))
    be.register_mem_pool_host(pool)
    assert be.batch_set_v1(keys, idx(range(4))) == [True] * 4
    for t in ((pool.k_buffer, pool.v_buffer) if isinstance(pool.kv_buffer, tuple) else (pool.kv_buffer,)):
        t.zero_()
    assert be.batch_get_v1(keys, idx([4, 5, 6, 7])) == [True] * 4
    for i in range(4):
        got = page_bytes(pool, 4 + i)
        assert torch.equal(got[0], want[i][0]) and torch.equal(got[1], want[i][1])
    assert be.batch_exists(keys + ["f" * 64] + keys) == 4
    assert be.exists(keys[0]) and not be.exists("e" * 64)
    stats = be.kvtier_stats()
    assert stats["pages"] == 4 and stats["corrupt_reads"] == 0
    be.close()
    # a restarted server (new backend over the same directory) finds the pages
    pool2 = sglang_pool(layout, *dims, seed=5)
    be2 = KvtierStorage(config(tmp_path, layout=layout))
    be2.register_mem_pool_host(pool2)
    assert be2.batch_exists(keys) == 4
    assert be2.batch_get_v1(keys[:1], idx([0])) == [True] and torch.equal(page_bytes(pool2, 0)[0], want[0][0])
    be2.close()
    # a pool of another geometry misses
    other = sglang_pool(layout, dims[0], 64)
    be3 = KvtierStorage(config(tmp_path, layout=layout))
    be3.register_mem_pool_host(other)
    assert be3.batch_exists(keys) == 0 and be3.batch_get_v1(keys[:1], idx([0])) == [False]
    be3.close()


def test_layer_first_is_refused_at_registration(tmp_path):
    pool = sglang_pool("page_first_direct", 128, 128)
    pool.layout = "layer_first"
    be = KvtierStorage(config(tmp_path))
    with pytest.raises(ValueError, match="supported layouts: 'page_first', 'page_first_direct'"):
        be.register_mem_pool_host(pool)


def test_unknown_extra_config_key_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['pathh'\].*capacity_bytes"):
        KvtierStorage(config(tmp_path, pathh="/x"))
    be = KvtierStorage(config(tmp_path, prefetch_threshold=256, capacity_bytes=1 << 24, io_threads=4))
    be.close()


def test_rank_replicated_models_write_from_one_rank_only(tmp_path):
    pool = sglang_pool("page_first_direct")
    reader = KvtierStorage(config(tmp_path, tp_rank=1, tp_size=2, mla=True))
    reader.register_mem_pool_host(pool)
    assert reader.batch_set_v1(["k" * 64], idx([0])) == [True]  # skipped: not the writer
    assert reader.batch_exists(["k" * 64]) == 0
    reader.close()
    writer = KvtierStorage(config(tmp_path, tp_rank=0, tp_size=2, mla=True))
    writer.register_mem_pool_host(pool)
    assert writer.batch_set_v1(["k" * 64], idx([0])) == [True]
    writer.close()
    reader = KvtierStorage(config(tmp_path, tp_rank=1, tp_size=2, mla=True))
    reader.register_mem_pool_host(sglang_pool("page_first_direct", seed=3))
    assert reader.batch_exists(["k" * 64]) == 1  # same namespace for every rank of a replicated model
    reader.close()


def test_flat_page_interface(tmp_path):
    pool = sglang_pool("page_first_direct", 128, 128)
    be = KvtierStorage(config(tmp_path))
    be.register_mem_pool_host(pool)
    page = torch.randint(0, 256, (12345,), dtype=torch.uint8)
    assert be.set("flat", page) and be.batch_set(["f2"], [page[:100]])
    out = torch.zeros_like(page)
    assert be.get("flat", out) is out and torch.equal(out, page)
    assert be.get("missing", out) is None
    assert be.batch_get(["f2"], [torch.zeros(100, dtype=torch.uint8)])[0] is not None
    be.close()


def test_flat_pages_from_many_threads_keep_their_own_bytes(tmp_path):
    # the flat-page calls share one scratch buffer: without holding it across copy and IO, one thread's
    # set could store another's bytes under its key
    import threading

    pool = sglang_pool("page_first_direct", 128, 128)
    be = KvtierStorage(config(tmp_path))
    be.register_mem_pool_host(pool)
    pages = {f"t{i}-{j}": torch.full((20000 + 4096 * (i % 3),), (i * 16 + j) % 251, dtype=torch.uint8)
             for i in range(6) for j in range(12)}
    errors = []

    def worker(i):
        for j in range(12):
            key = f"t{i}-{j}"
            if not be.set(key, pages[key]):
                errors.append(f"set {key}")
            out = torch.empty_like(pages[key])
            if be.get(key, out) is None or not torch.equal(out, pages[key]):
                errors.append(f"get {key}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    be.close()


def test_page_hashes_equal_sglang():
    from sglang.srt.mem_cache.utils import get_hash_str

    rng = random.Random(3)
    for _ in range(10):
        ps = rng.choice([1, 4, 16, 64])
        toks = [rng.randrange(0, 200_000) for _ in range(rng.randrange(ps, 400))]
        ours = kvtier.page_hashes(toks, ps)
        theirs = get_hash_str(toks, None, page_size=ps)
        theirs = [theirs] if isinstance(theirs, str) else list(theirs)
        assert ours == theirs
        tail = get_hash_str(toks[ps:], ours[0], page_size=ps)
        tail = [tail] if isinstance(tail, str) else list(tail)
        assert kvtier.page_hashes(toks[ps:], ps, prior_hash=ours[0]) == tail


def test_enable_metrics_feeds_sglangs_own_collector(tmp_path):
    """--enable-metrics: SGLang reads get_stats() every step, sets `.prefetch_stats` on it and hands it to its
    StorageMetricsCollector, which asserts a StorageMetrics (a dict crashed the scheduler). The figures are
    the pages each batch moved and their GB/s, drained on every call."""
    from sglang.srt.observability.metrics_collector import StorageMetrics, StorageMetricsCollector

    pool = sglang_pool("page_first_direct")
    be = KvtierStorage(config(tmp_path, metrics=True))
    be.register_mem_pool_host(pool)
    keys = [f"{i:064x}" for i in range(4)]
    assert be.batch_set_v1(keys, idx(range(4))) == [True] * 4
    assert be.batch_get_v1(keys[:3] + ["e" * 64], idx([4, 5, 6, 7])) == [True, True, True, False]
    m = be.get_stats()
    assert isinstance(m, StorageMetrics)
    assert m.backup_pgs == [4] and m.prefetch_pgs == [3]
    assert len(m.backup_bandwidth) == 1 and m.backup_bandwidth[0] > 0 and m.prefetch_bandwidth[0] > 0
    m.prefetch_stats = {}  # what SGLang's cache does before logging
    StorageMetricsCollector(labels={"tp_rank": "0"}).log_storage_metrics(m)
    again = be.get_stats()
    assert again.backup_pgs == [] and again.prefetch_pgs == [], "drained on each call"
    be.close()
    # metrics off (the default): nothing is recorded, and get_stats is still what SGLang expects
    be = KvtierStorage(config(tmp_path / "off"))
    be.register_mem_pool_host(pool)
    be.batch_set_v1(keys[:1], idx([0]))
    assert isinstance(be.get_stats(), StorageMetrics) and be.get_stats().backup_pgs == []
    be.close()


def test_dp_attention_ranks_get_their_own_namespaces(tmp_path):
    """With DP attention SGLang's tp_rank is group-local: rank 0 of DP group 0 and rank 0 of DP group 1 are
    two processes with the same tp_rank. They must not share a namespace (its writer lock would refuse the
    second); dp_rank names it. dp_rank 0 keeps the name stores had before."""
    pool = sglang_pool("page_first_direct")
    cfgs = [config(tmp_path), config(tmp_path)]
    cfgs[1].dp_rank = 1
    a, b = KvtierStorage(cfgs[0]), KvtierStorage(cfgs[1])
    a.register_mem_pool_host(pool)
    b.register_mem_pool_host(pool)  # opened while `a` holds its namespace
    assert a.store.get_stats()["dir"] != b.store.get_stats()["dir"]
    assert "|dp=1|" in b.store.namespace_for(pool) and "|dp=" not in a.store.namespace_for(pool)
    assert a.batch_set_v1(["a" * 64], idx([0])) == [True] and b.batch_exists(["a" * 64]) == 0
    a.close()
    b.close()


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_mla_pool_round_trip(tmp_path, layout):
    """DeepSeek-style MLA: SGLang's MLA host pool gives one object per page; kvtier stores it whole, reads
    it back bit-exact, and names the latent/rope geometry in the namespace."""
    pool = sglang_mla_pool(layout)
    ptrs, sizes = pool.get_page_buffer_meta(idx([2]))
    assert len(ptrs) == 1

    def page(p):
        ptr, n = pool.get_page_buffer_meta(idx([p]))
        off = ptr[0] - pool.kv_buffer.data_ptr()
        return pool.kv_buffer.view(torch.uint8).reshape(-1)[off : off + n[0]].clone()

    want = [page(p) for p in range(4)]
    be = KvtierStorage(config(tmp_path, mla=True, layout=layout))
    be.register_mem_pool_host(pool)
    assert "|mla=64+16" in be.store.namespace_for(pool)
    keys = [f"{i:064x}" for i in range(4)]
    assert be.batch_set_v1(keys, idx(range(4))) == [True] * 4
    pool.kv_buffer.zero_()
    assert be.batch_get_v1(keys, idx([4, 5, 6, 7])) == [True] * 4
    for i in range(4):
        assert torch.equal(page(4 + i), want[i])
    assert be.batch_exists(keys + ["f" * 64]) == 4
    assert be.kvtier_stats()["pages"] == 4
    assert be.store.delete(keys[:1]) == 1 and be.batch_exists(keys) == 0
    be.close()


def test_mla_ranks_share_the_writers_pages(tmp_path):
    """MLA at TP >= 2: every rank holds the same latent KV and only the writer rank stores it. The other
    ranks used to open the same namespace for writing, which its lock refuses; now they read it, following
    the writer: a page the writer stores is a hit for them (bit-exact), one it deletes a miss. A reader
    registered before the writer created the namespace misses until it exists."""
    early = KvtierStorage(config(tmp_path, mla=True, tp_rank=2, tp_size=4))
    early.register_mem_pool_host(sglang_mla_pool("page_first_direct", seed=3))
    assert early.batch_exists(["a" * 64]) == 0 and early.batch_get_v1(["a" * 64], idx([0])) == [False]
    writer_pool, reader_pool = sglang_mla_pool("page_first_direct"), sglang_mla_pool("page_first_direct", seed=9)
    w = KvtierStorage(config(tmp_path, mla=True, tp_rank=0, tp_size=4))
    r = KvtierStorage(config(tmp_path, mla=True, tp_rank=1, tp_size=4))
    w.register_mem_pool_host(writer_pool)
    r.register_mem_pool_host(reader_pool)  # the writer holds the namespace: this used to fail
    keys = [f"{i:064x}" for i in range(3)]
    assert w.batch_set_v1(keys, idx(range(3))) == [True] * 3
    assert r.batch_set_v1(keys, idx(range(3))) == [True] * 3  # not the writer: nothing written
    assert r.batch_exists(keys) == 3
    assert r.batch_get_v1(keys, idx([4, 5, 6])) == [True] * 3
    wb, rb = writer_pool.kv_buffer.view(torch.uint8), reader_pool.kv_buffer.view(torch.uint8)
    assert torch.equal(rb[4:7], wb[0:3])
    w.store.delete(keys[:1])
    # a follower looks at the writer's journal on a miss or at least every 100 ms (docs/STORE.md, followers):
    # the deleted page is a miss for it within that
    import time

    t0 = time.monotonic()
    while r.batch_exists(keys) != 0 and time.monotonic() - t0 < 2.0:
        time.sleep(0.02)
    assert time.monotonic() - t0 < 0.5, "the follower saw the delete late"
    assert r.batch_exists(keys) == 0 and r.batch_get_v1(keys[:1], idx([4])) == [False]
    import time

    time.sleep(1.1)  # the early reader tries to open again at most once a second
    assert early.batch_exists(keys[1:]) == 2
    for be in (early, w, r):
        be.close()


def test_mla_ranks_in_separate_processes(tmp_path):
    """The writer rank in another process, holding the namespace's lock while this process (rank 1) reads:
    pages it stores after the reader opened are hits here, bit-exact."""
    import subprocess
    import sys

    code = f"""
import sys, torch
sys.path.insert(0, {str(__import__("os").path.dirname(__file__))!r})
from kvtier.integrations.sglang import KvtierStorage
from sglang_pools import config, idx, sglang_mla_pool
from pathlib import Path
w = KvtierStorage(config(Path(sys.argv[1]), mla=True, tp_rank=0, tp_size=2))
w.register_mem_pool_host(sglang_mla_pool("page_first_direct", seed=11))
print("open", flush=True)
sys.stdin.readline()
keys = [f"{{i:064x}}" for i in range(3)]
print("stored" if w.batch_set_v1(keys, idx(range(3))) == [True] * 3 else "failed", flush=True)
sys.stdin.readline()
w.close()
"""
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "open", "the writer process did not start"
        pool = sglang_mla_pool("page_first_direct", seed=12)
        r = KvtierStorage(config(tmp_path, mla=True, tp_rank=1, tp_size=2))
        r.register_mem_pool_host(pool)  # the writer process holds the lock
        keys = [f"{i:064x}" for i in range(3)]
        assert r.batch_exists(keys) == 0
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "stored"
        assert r.batch_exists(keys) == 3
        assert r.batch_get_v1(keys, idx([4, 5, 6])) == [True] * 3
        want = sglang_mla_pool("page_first_direct", seed=11).kv_buffer.view(torch.uint8)
        assert torch.equal(pool.kv_buffer.view(torch.uint8)[4:7], want[0:3])
        r.close()
    finally:
        p.stdin.write("quit\n")
        p.stdin.flush()
        p.wait(timeout=60)
        err = p.stderr.read()
        for f in (p.stdin, p.stdout, p.stderr):
            f.close()
    assert p.returncode == 0, err


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_kvtier_and_sglang_mla_pools_share_pages(tmp_path, layout):
    """A page stored from kvtier's MLA host pool is a hit, bit-exact, for SGLang's own MLA host pool of the
    same geometry, and the other way round: same namespace, same object per page."""
    sg = sglang_mla_pool(layout, seed=5)
    dp = kvtier.MLADeviceKVPool(7 * PS, PS, L, 64, 16, torch.bfloat16, "cpu")  # 7 // 1 + 1 = 8 pages, as sg's
    kv = kvtier.host_pool_for(dp, layout=layout, host_to_device_ratio=1.0)
    assert kv.page_num == sg.page_num and tuple(kv.kv_buffer.shape) == tuple(sg.kv_buffer.shape)
    assert [len(x) for x in kv.get_page_buffer_meta(idx([3]))] == [1, 1]
    assert kv.get_page_buffer_meta(idx([3]))[1] == sg.get_page_buffer_meta(idx([3]))[1]
    kv.kv_buffer.view(torch.uint8).copy_(torch.randint(0, 256, kv.kv_buffer.view(torch.uint8).shape, dtype=torch.uint8))
    a, b = KvtierStorage(config(tmp_path, mla=True, layout=layout)), None
    a.register_mem_pool_host(kv)
    assert a.store.namespace_for(kv) == a.store.namespace_for(sg)
    keys = [f"{i:064x}" for i in range(8)]
    assert a.batch_set_v1(keys[:4], idx([0, 1, 2, 3])) == [True] * 4
    a.close()
    b = KvtierStorage(config(tmp_path, mla=True, layout=layout))
    b.register_mem_pool_host(sg)
    assert b.batch_exists(keys[:4]) == 4
    assert b.batch_get_v1(keys[:4], idx([4, 5, 6, 7])) == [True] * 4
    page = PS * L * 80 * 2
    flat_sg, flat_kv = sg.kv_buffer.view(torch.uint8).reshape(-1), kv.kv_buffer.view(torch.uint8).reshape(-1)
    if layout == "page_first_direct":
        assert torch.equal(flat_sg[4 * page:8 * page], flat_kv[:4 * page])
    else:
        assert torch.equal(sg.kv_buffer[idx([4, 5, 6, 7])].view(torch.uint8), kv.kv_buffer[idx([0, 1, 2, 3])].view(torch.uint8))
    assert b.batch_set_v1(keys[4:], idx([0, 1, 2, 3])) == [True] * 4  # SGLang's pool writes, kvtier's reads
    b.close()
    a = KvtierStorage(config(tmp_path, mla=True, layout=layout))
    a.register_mem_pool_host(kv)
    assert a.batch_get_v1(keys[4:], idx([4, 5, 6, 7])) == [True] * 4
    if layout == "page_first_direct":
        assert torch.equal(flat_kv[4 * page:8 * page], flat_sg[:4 * page])
    a.close()


def test_batch_exists_answers_with_the_pages_worth_loading(tmp_path, caplog):
    """The restore planner (on by default): SGLang is told only the leading pages whose read is predicted faster
    than its prefill computing them, judged by the tier's own measurement; the pages themselves stay stored."""
    from kvtier.planner import TierMeter

    pool = sglang_pool("page_first_direct")
    keys = [f"{i:064x}" for i in range(6)]
    extra = {k: v for k, v in config(tmp_path).extra_config.items() if k != "restore_planner"}
    cfg = config(tmp_path)
    cfg.extra_config = extra  # the defaults: planner on, prefill rate from the default engine
    be = KvtierStorage(cfg)
    be.register_mem_pool_host(pool)
    assert be.planner.enabled and be.batch_set_v1(keys, idx(range(6))) == [True] * 6
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        for gbps, want in ((1000.0, 6), (1e-4, 0), (1e-4, 0)):  # a tier far faster / far slower than a prefill
            be.store.meter = TierMeter("disk")
            be.store.meter.seed(read_GBps=gbps)
            assert be.batch_exists(keys) == want and be.store.batch_exists(keys) == 6
    stats = be.kvtier_stats()["restore_planner"]
    assert stats["plans"] == {"load": 1, "recompute": 2} and stats["declined_tokens"] == 2 * 6 * PS
    # declining stored pages is said once, with why and what to set
    (said,) = [r.getMessage() for r in caplog.records if "restore planner reports" in r.getMessage()]
    assert "0 of 6 stored pages" in said and "prefill_tokens_per_s not set" in said and "restore_planner: false" in said
    be.close()
    # the operator's prefill rate decides against the measured tier: compute that costs nothing never loads,
    # compute that takes a second per token always does
    for rate, want in ((1e15, 0), (1.0, 6)):
        be = KvtierStorage(config(tmp_path, restore_planner=True, prefill_tokens_per_s=rate))
        be.register_mem_pool_host(pool)
        assert be.batch_exists(keys) == want
        assert be.batch_get_v1(keys, idx(range(6))) == [True] * 6  # what SGLang is told to load still loads
        be.close()
    for bad, name in (({"restore_planner": "yes"}, "restore_planner"), ({"prefill_tokens_per_s": -1}, "prefill_tokens_per_s"),
                      ({"prefill_tokens_per_s": True}, "prefill_tokens_per_s")):
        with pytest.raises(ValueError, match=name):
            KvtierStorage(config(tmp_path, **bad))


def test_sizes_with_units_in_the_extra_config(tmp_path):
    be = KvtierStorage(config(tmp_path, capacity_bytes="64G"))
    assert be.store.capacity_bytes == 64 << 30
    be.close()
    with pytest.raises(ValueError, match="`capacity_bytes`"):
        KvtierStorage(config(tmp_path, capacity_bytes="64 gallons"))


def test_the_documented_extra_configs_open_a_backend(tmp_path):
    """Every --hicache-storage-backend-extra-config of the README and docs/SGLANG.md is accepted as written
    (its path swapped for the test's): sizes with units, the cluster keys only where a cluster is named."""
    import json
    import os
    import re

    root = os.path.join(os.path.dirname(__file__), "..")
    texts = []
    for p in ("README.md", os.path.join("docs", "SGLANG.md")):
        with open(os.path.join(root, p)) as f:
            texts.append(f.read())
    found = [json.loads(raw) for t in texts for raw in re.findall(r"--hicache-storage-backend-extra-config '(\{.*?\})'", t, flags=re.S)]
    assert len(found) >= 4
    for i, extra in enumerate(found):
        if "mooncake" in extra.get("tiers", []):
            continue  # needs a running cluster: tests/test_mooncake_sglang.py runs that one
        extra = {**extra, "path": str(tmp_path / str(i))}
        cfg = config(tmp_path)
        cfg.extra_config = extra
        be = KvtierStorage(cfg)
        assert be.store.capacity_bytes == kvtier.config.parse_size("capacity_bytes", extra.get("capacity_bytes", 64 << 30), 1)
        be.close()
