"""Tenants through the real engines' interfaces (SGLang and vLLM as installed by `make test`; transformers):
a request's cache_salt or a deployment's tenant never lets one tenant hit another's pages, the same tenant
does hit, and with a keyring the pages are sealed on disk. These tests do not skip."""

from array import array

import torch

from kvtier.tenants import Keyring, tenant_keys
from kvtier.integrations.sglang import KvtierStorage
from sglang_pools import config, idx, page_bytes, sglang_pool

from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_storage_hash_str

TOKENS = list(range(3000, 3000 + 4 * 4))


def sglang_keys(salt):
    """SGLang's own L3 storage keys for TOKENS in a request with ``cache_salt=salt`` (page size 4)."""
    return get_storage_hash_str(RadixKey(array("i", TOKENS), cache_salt=salt), None, page_size=4)


def zero(pool):
    for t in ((pool.k_buffer, pool.v_buffer) if isinstance(pool.kv_buffer, tuple) else (pool.kv_buffer,)):
        t.zero_()


def test_sglang_request_salts_never_share_pages_in_kvtier(tmp_path):
    alice, bob, none = sglang_keys("alice"), sglang_keys("bob"), sglang_keys(None)
    assert len({*alice, *bob, *none}) == 12  # SGLang scopes its storage keys by the salt itself
    pool = sglang_pool("page_first_direct")
    want = [page_bytes(pool, p) for p in range(4)]
    be = KvtierStorage(config(tmp_path))
    be.register_mem_pool_host(pool)
    assert be.batch_set_v1(alice, idx(range(4))) == [True] * 4
    assert be.batch_exists(bob) == 0 and be.batch_exists(none) == 0
    assert be.batch_get_v1(bob, idx(range(4, 8))) == [False] * 4
    zero(pool)
    assert be.batch_exists(alice) == 4 and be.batch_get_v1(alice, idx(range(4))) == [True] * 4
    assert all(torch.equal(a, b) for p in range(4) for a, b in zip(page_bytes(pool, p), want[p]))
    be.close()


def test_sglang_deployment_tenants_are_kept_apart_sealed_and_erased(tmp_path):
    kr = Keyring.init(tmp_path / "keys")
    keys = sglang_keys(None)
    pool = sglang_pool("page_first_direct", seed=3)
    want = [page_bytes(pool, p) for p in range(4)]
    a = KvtierStorage(config(tmp_path / "s", tenant="acme", keyring=str(tmp_path / "keys")))
    a.register_mem_pool_host(pool)
    assert a.batch_set_v1(keys, idx(range(4))) == [True] * 4
    stored = set(a.store.native_store().keys())
    scoped = tenant_keys("acme", keys)  # the engine's keys, scoped to the deployment's tenant, keyed on disk
    assert stored == set(kr.stored_names([f"{k}.{side}" for k in scoped for side in "kv"]))
    a.close()
    b = KvtierStorage(config(tmp_path / "s", tenant="globex", keyring=str(tmp_path / "keys")))
    b.register_mem_pool_host(pool)
    assert b.batch_exists(keys) == 0
    b.close()
    a = KvtierStorage(config(tmp_path / "s", tenant="acme", keyring=str(tmp_path / "keys")))
    a.register_mem_pool_host(pool)
    zero(pool)
    assert a.batch_exists(keys) == 4 and a.batch_get_v1(keys, idx(range(4))) == [True] * 4
    assert all(torch.equal(x, y) for p in range(4) for x, y in zip(page_bytes(pool, p), want[p]))
    assert a.erase_tenant("acme") == 4  # pages
    assert a.batch_exists(keys) == 0
    a.close()
    assert kr.tenants()  # the tenant's key was created at its first write


def test_sglang_hybrid_pools_are_scoped_and_sealed_too(tmp_path):
    """The v2 interface's extra pools (SWA KV, Mamba state) take the deployment's tenant and keyring like the
    anchor: another tenant finds none of them, the same tenant finds all, and they are sealed on disk."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy
    from sglang_pools import hybrid, keys_for, snapshot

    TRAIL = PoolHitPolicy.TRAILING_PAGES

    Keyring.init(tmp_path / "keys")
    ring = str(tmp_path / "keys")

    def open_backend(tenant, pools):
        kv, swa, mamba = pools
        be = KvtierStorage(config(tmp_path / "s", tenant=tenant, keyring=ring))
        be.register_mem_pool_host(kv)
        for name, p in ((PoolName.KV, kv), (PoolName.SWA, swa), (PoolName.MAMBA, mamba)):
            be.register_mem_host_pool_v2(p, name)
        be.on_host_pools_registered()
        return be

    pools = hybrid()
    keys = keys_for(4)
    transfers = [PoolTransfer(PoolName.SWA, host_indices=idx([2, 3]), keys=keys[2:], hit_policy=TRAIL),
                 PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([5]), keys=keys[3:], hit_policy=TRAIL)]
    want = snapshot(*pools)
    be = open_backend("acme", pools)
    assert be.batch_set_v1(keys, idx([0, 1, 2, 3])) == [True] * 4
    assert be.batch_set_v2(transfers) == {PoolName.SWA: [True, True], PoolName.MAMBA: [True]}
    assert all("|sealed=" in p.namespace for p in be._pools.values())
    be.close()
    other = open_backend("globex", pools)
    res = other.batch_exists_v2(keys, transfers)
    assert res.kv_hit_pages == 0 and not any(res.extra_pool_hit_pages.get(n) for n in (PoolName.SWA, PoolName.MAMBA))
    other.close()
    same = open_backend("acme", pools)
    res = same.batch_exists_v2(keys, transfers)
    assert res.kv_hit_pages == 4 and res.extra_pool_hit_pages[PoolName.MAMBA] == 4
    kv, swa, mamba = pools
    for t in [*kv.kv_buffer, swa.kv_buffer, *mamba.get_hybrid_pool_buffer()]:
        t.zero_()
    assert same.batch_get_v2(transfers) == {PoolName.SWA: [True, True], PoolName.MAMBA: [True]}
    got = snapshot(*pools)
    assert torch.equal(got[2][2:4], want[2][2:4])  # SWA K pages 2-3, opened bit for bit
    assert same.erase_tenant("acme") > 0
    assert same.batch_exists_v2(keys, transfers).kv_hit_pages == 0
    same.close()
