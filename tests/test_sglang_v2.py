"""SGLang's v2 storage interface (hybrid models: SWA KV, Mamba state beside the full-attention KV) against the
real package on the CPU, with SGLang's own host pool classes and its own HostPoolGroup. Hit decisions are
compared with SGLang's own file backend on the same presence patterns. No skips: an SGLang release that
changes these interfaces must fail here."""

import random

import pytest
import torch
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang_pools import PS, config, group, hybrid, idx, keys_for, mamba_pool, sglang_pool, snapshot

from kvtier import InvalidArgumentError
from kvtier.integrations.sglang import KvtierStorage

ALL, TRAIL = PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES


def backend(path, **kw):
    be = KvtierStorage(config(path, **kw))
    return be


@pytest.mark.parametrize("as_group", [False, True])
def test_hybrid_round_trip_bit_exact(tmp_path, as_group):
    kv, swa, mamba = hybrid()
    be = backend(tmp_path)
    if as_group:
        be.register_mem_pool_host(group(kv, swa, mamba))
    else:  # what SGLang's HybridCacheController does
        be.register_mem_pool_host(kv)
        for name, p in ((PoolName.KV, kv), (PoolName.SWA, swa), (PoolName.MAMBA, mamba)):
            be.register_mem_host_pool_v2(p, name)
        be.on_host_pools_registered()
    keys = keys_for(4)
    want = snapshot(kv, swa, mamba)
    assert be.batch_set_v1(keys, idx([0, 1, 2, 3])) == [True] * 4
    transfers = [PoolTransfer(PoolName.SWA, host_indices=idx([2, 3]), keys=keys[2:], hit_policy=TRAIL),
                 PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([5]), keys=keys[3:], hit_policy=TRAIL)]
    assert be.batch_set_v2(transfers) == {PoolName.SWA: [True, True], PoolName.MAMBA: [True]}
    res = be.batch_exists_v2(keys, transfers)
    assert res.kv_hit_pages == 4 and res.extra_pool_hit_pages == {PoolName.KV: 4, PoolName.SWA: 4, PoolName.MAMBA: 4}
    for t in [*kv.kv_buffer, swa.kv_buffer, *mamba.get_hybrid_pool_buffer()]:
        t.zero_()
    assert be.batch_get_v1(keys, idx([0, 1, 2, 3])) == [True] * 4
    assert be.batch_get_v2(transfers) == {PoolName.SWA: [True, True], PoolName.MAMBA: [True]}
    got = snapshot(kv, swa, mamba)
    # the KV pages (K and V), SWA pages 2-3 and Mamba slot 5 are back, bit for bit
    for g, w in zip(got[:2], want[:2]):
        assert torch.equal(g[:4], w[:4])
    assert len(got) == 6  # anchor K, V; SWA K, V (get_hybrid_pool_buffer); Mamba temporal, conv
    for g, w in zip(got[2:4], want[2:4]):
        assert torch.equal(g[2:4], w[2:4]) and not g[:2].any() and not g[4:].any()
    for g, w in zip(got[4:], want[4:]):  # Mamba temporal and conv: slot 5 only
        g, w = g.reshape(-1), w.reshape(-1)
        slot = w.numel() // mamba.size
        assert torch.equal(g[5 * slot:6 * slot], w[5 * slot:6 * slot])
        assert not g[:5 * slot].any()
    be.close()


def test_exists_v2_agrees_with_sglangs_file_backend(tmp_path):
    """Random presence patterns of KV, SWA (trailing window 2) and Mamba (trailing 1, or every page): kvtier's
    answer equals SGLang's own HiCacheFile's, field by field."""
    rng = random.Random(7)
    kv, swa, mamba = hybrid()
    ours = backend(tmp_path / "kvtier")
    ours.register_mem_pool_host(group(kv, swa, mamba))
    theirs = HiCacheFile(config(tmp_path / "file"), file_path=str(tmp_path / "file"))
    theirs.register_mem_pool_host(kv)
    for name, p in ((PoolName.SWA, swa), (PoolName.MAMBA, mamba)):
        theirs.register_mem_host_pool_v2(p, name)
    for trial in range(12):
        keys = keys_for(6, trial)
        kv_n = rng.randint(0, 6)
        ours.batch_set_v1(keys[:kv_n], idx(range(kv_n)))
        for k in keys[:kv_n]:  # (presence is all its exists check reads)
            assert theirs.set(k, torch.zeros(16, dtype=torch.uint8))
        for name, page_size in ((PoolName.SWA, PS), (PoolName.MAMBA, 1)):
            chosen = [i for i in range(6) if rng.random() < 0.6]
            if not chosen:
                continue
            h = torch.tensor([i * page_size + j for i in chosen for j in range(page_size)], dtype=torch.int64)
            t = [PoolTransfer(name, host_indices=h, keys=[keys[i] for i in chosen])]
            assert all(ours.batch_set_v2(t)[name])
            assert all(theirs.batch_set_v2(t)[name])
        for policies in ((TRAIL, TRAIL), (ALL, TRAIL), (TRAIL, ALL)):
            transfers = [PoolTransfer(PoolName.SWA, keys=keys[-2:], hit_policy=policies[0]),
                         PoolTransfer(PoolName.MAMBA, keys=keys[-1:], hit_policy=policies[1])]
            a, b = ours.batch_exists_v2(keys, transfers), theirs.batch_exists_v2(keys, transfers)
            assert (a.kv_hit_pages, a.extra_pool_hit_pages, a.restorable_prefix_pages) == \
                (b.kv_hit_pages, b.extra_pool_hit_pages, b.restorable_prefix_pages), (trial, policies)
    ours.close()


def test_pool_without_zero_copy_metadata_is_stored_as_flat_pages(tmp_path):
    """A Mamba pool with slot side state offers no zero-copy metadata (SGLang raises NotImplementedError):
    kvtier stores whole flat pages instead, under a namespace that says so."""
    kv, swa, mamba = hybrid()

    def refuse(indices):
        raise NotImplementedError("no zero copy with slot side states")

    mamba.get_page_buffer_meta = refuse
    be = backend(tmp_path)
    be.register_mem_pool_host(kv)
    be.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    assert be._pools["mamba"].flat and "|objs=flat:" in be._pools["mamba"].namespace
    keys = keys_for(3)
    want = snapshot(mamba)
    t = [PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([1, 4, 6]), keys=keys)]
    assert be.batch_set_v2(t) == {PoolName.MAMBA: [True] * 3}
    for x in mamba.get_hybrid_pool_buffer():
        x.zero_()
    assert be.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([2, 3, 7]), keys=keys)]) == \
        {PoolName.MAMBA: [True] * 3}
    got = snapshot(mamba)
    for g, w in zip(got, want):
        g, w = g.reshape(-1), w.reshape(-1)
        slot = w.numel() // mamba.size
        for src, dst in ((1, 2), (4, 3), (6, 7)):
            assert torch.equal(g[dst * slot:(dst + 1) * slot], w[src * slot:(src + 1) * slot])
    be.close()


def test_bad_v2_calls_are_clear_and_harmless(tmp_path):
    kv, swa, mamba = hybrid()
    be = backend(tmp_path)
    be.register_mem_pool_host(kv)
    be.register_mem_host_pool_v2(swa, PoolName.SWA)
    keys = keys_for(2)
    with pytest.raises(InvalidArgumentError, match="pool 'mamba' was never registered"):
        be.batch_set_v2([PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([1]), keys=keys[:1])])
    # a host index count that does not match the keys: nothing stored, no exception (SGLang's backends agree)
    assert be.batch_set_v2([PoolTransfer(PoolName.SWA, host_indices=idx([1]), keys=keys)]) == {PoolName.SWA: [False, False]}
    assert be._pools["swa"].exists(keys) == [False, False]
    # an index past the pool never reaches a copy
    with pytest.raises(InvalidArgumentError, match=r"slots must be in \[0, 32\), got 399"):
        be.batch_set_v2([PoolTransfer(PoolName.SWA, host_indices=idx([99]), keys=keys[:1])])
    assert be._pools["swa"].exists(keys[:1]) == [False]
    be.batch_set_v1(keys, idx([0, 1]))
    with pytest.raises(InvalidArgumentError, match="hit policy"):
        be.batch_exists_v2(keys, [PoolTransfer(PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.BLOCK_GROUPS)])
    be.close()


def test_mla_model_pools_follow_sglangs_writer_rules(tmp_path):
    """In an MLA model (rank-replicated KV), Mamba state is still sharded by TP rank (every rank writes its
    own); the other extra pools are written by the writer rank and read by the others."""
    from sglang_pools import sglang_mla_pool

    writer, reader = backend(tmp_path, mla=True, tp_rank=0, tp_size=2), backend(tmp_path, mla=True, tp_rank=1, tp_size=2)
    pools = {}
    for be, seed in ((writer, 0), (reader, 10)):
        anchor, swa, mamba = sglang_mla_pool("page_first_direct", seed=seed), sglang_pool("page_first_direct", 128, 128, seed=seed + 1), mamba_pool(seed + 2)
        be.register_mem_pool_host(anchor)
        be.register_mem_host_pool_v2(swa, PoolName.SWA)
        be.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
        pools[be] = (anchor, swa, mamba)
    assert "|tp=0/2|" in writer._pools["mamba"].namespace and "|tp=1/2|" in reader._pools["mamba"].namespace
    assert "|tp=0/1|" in writer._pools["swa"].namespace == reader._pools["swa"].namespace
    keys = keys_for(2)
    t = [PoolTransfer(PoolName.SWA, host_indices=idx([0, 1]), keys=keys),
         PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([0, 1]), keys=keys)]
    assert writer.batch_set_v2(t) == {PoolName.SWA: [True, True], PoolName.MAMBA: [True, True]}
    assert reader.batch_set_v2(t)[PoolName.MAMBA] == [True, True]
    swa_w = pools[writer][1].kv_buffer.view(torch.uint8)
    swa_r = pools[reader][1].kv_buffer.view(torch.uint8)
    assert not torch.equal(swa_r, swa_w)
    assert reader.batch_get_v2([t[0]]) == {PoolName.SWA: [True, True]}  # the writer's SWA pages
    assert torch.equal(swa_r[:, :2], swa_w[:, :2]) and not torch.equal(swa_r[:, 2:], swa_w[:, 2:])  # (K, V) x pages
    writer.close()
    reader.close()


def test_factory_backend_serves_v2(tmp_path):
    kv, swa, mamba = hybrid()
    be = StorageBackendFactory.create_backend("dynamic", config(tmp_path), kv)
    assert isinstance(be, KvtierStorage)
    be.register_mem_pool_host(group(kv, swa, mamba))
    keys = keys_for(1)
    assert be.batch_set_v1(keys, idx([0])) == [True]
    assert be.batch_set_v2([PoolTransfer(PoolName.SWA, host_indices=idx([0]), keys=keys)]) == {PoolName.SWA: [True]}
    assert be.batch_exists_v2(keys, [PoolTransfer(PoolName.SWA, keys=keys, hit_policy=ALL)]).kv_hit_pages == 1
    be.close()


def mamba_pool_with(temporal_dtype, seed=0, slots=8):
    info = MambaStateBufferInfo(temporal=torch.zeros(2, slots + 1, 4, 8, dtype=temporal_dtype),
                                conv=(torch.zeros(2, slots + 1, 3, 16, dtype=torch.bfloat16),))
    pool = MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout="page_first")
    for t in pool.get_hybrid_pool_buffer():
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8))
    return pool


def test_same_sizes_other_dtype_is_another_namespace(tmp_path):
    """A bf16 and an fp16 SSM state have equal byte sizes: the pool's buffer dtypes and shapes name the
    namespace, so a restarted server with the other dtype misses instead of reading reinterpreted bytes."""
    kv = sglang_pool("page_first_direct")
    a = backend(tmp_path)
    a.register_mem_pool_host(kv)
    a.register_mem_host_pool_v2(mamba_pool_with(torch.bfloat16), PoolName.MAMBA)
    keys = keys_for(1)
    assert a.batch_set_v2([PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([3]), keys=keys)]) == {PoolName.MAMBA: [True]}
    a.close()
    b = backend(tmp_path)
    b.register_mem_pool_host(kv)
    b.register_mem_host_pool_v2(mamba_pool_with(torch.float16), PoolName.MAMBA)
    assert "bfloat16" not in b._pools["mamba"].namespace.split("|bufs=")[1].split(";")[0]
    assert b.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([0]), keys=keys)]) == {PoolName.MAMBA: [False]}
    b.close()


def test_fp8_variants_are_told_apart(tmp_path):
    """SGLang's host pools hold every fp8 KV cache as uint8: with `kv_cache_dtype` in the extra config the
    namespace names the variant, so an fp8_e5m2 page is never served to an fp8_e4m3 server."""
    def pool():  # an fp8 cache as SGLang's host pool holds it: uint8, 2 x 128 fp8 values per head
        p = sglang_pool("page_first_direct", 128, 128)
        p.kv_buffer, p.dtype, p.head_dim, p.v_head_dim = p.kv_buffer.view(torch.uint8), torch.uint8, 256, 256
        return p
    e5 = backend(tmp_path, kv_cache_dtype="fp8_e5m2")
    e5.register_mem_pool_host(pool())
    keys = keys_for(1)
    assert e5.batch_set_v1(keys, idx([0])) == [True]
    e5.close()
    e4 = backend(tmp_path, kv_cache_dtype="fp8_e4m3")
    e4.register_mem_pool_host(pool())
    assert "|dtype=fp8_e4m3|" in e4.store.namespace_for(e4.store.pool) and e4.batch_exists(keys) == 0
    e4.close()


def test_flat_path_refuses_bad_indices_before_any_io(tmp_path):
    kv, swa, mamba = hybrid()
    mamba.get_page_buffer_meta = lambda indices: (_ for _ in ()).throw(NotImplementedError("side state"))
    be = backend(tmp_path)
    be.register_mem_pool_host(kv)
    be.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    before = snapshot(mamba)
    keys = keys_for(2)
    for bad in ([1, -1], [1, mamba.size]):  # a negative slot would wrap in torch; one past the pool
        with pytest.raises(InvalidArgumentError, match="host_indices"):
            be.batch_set_v2([PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor(bad), keys=keys)])
        with pytest.raises(InvalidArgumentError, match="host_indices"):
            be.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor(bad), keys=keys)])
    assert be._pools["mamba"].exists(keys) == [False, False]
    assert all(torch.equal(a, b) for a, b in zip(snapshot(mamba), before))
    with pytest.raises(InvalidArgumentError, match="int64"):
        be.batch_set_v2([PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([1, 2], dtype=torch.int32), keys=keys)])
    be.close()


def test_a_bad_transfer_stores_nothing_of_the_batch(tmp_path):
    kv, swa, mamba = hybrid()
    be = backend(tmp_path)
    be.register_mem_pool_host(group(kv, swa, mamba))
    keys = keys_for(2)
    for bad in (PoolTransfer(PoolName.INDEXER, host_indices=idx([0]), keys=keys[:1]),  # never registered
                PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([99]), keys=keys[:1])):  # past the pool
        with pytest.raises(InvalidArgumentError):
            be.batch_set_v2([PoolTransfer(PoolName.KV, host_indices=idx([0, 1]), keys=keys),
                             PoolTransfer(PoolName.SWA, host_indices=idx([0, 1]), keys=keys), bad])
        assert be.batch_exists(keys) == 0 and be._pools["swa"].exists(keys) == [False, False]
    be.close()


def test_closed_pools_stay_closed_and_can_be_registered_again(tmp_path):
    from kvtier import ClosedError

    kv, swa, mamba = hybrid()
    be = backend(tmp_path)
    be.register_mem_pool_host(kv)
    be.register_mem_host_pool_v2(swa, PoolName.SWA)
    be.register_mem_host_pool_v2(swa, PoolName.SWA)  # again: the old store gives its lock back first
    keys = keys_for(1)
    pool = be._pools["swa"]
    assert pool.set(keys, idx([0])) == [True]
    be.close()
    with pytest.raises(ClosedError):
        pool.set(keys, idx([1]))  # a thread still holding it does not reopen the namespace
    again = backend(tmp_path)  # so a new backend in the same process can take the lock
    again.register_mem_pool_host(kv)
    again.register_mem_host_pool_v2(swa, PoolName.SWA)
    assert again._pools["swa"].exists(keys) == [True]
    again.close()
